"""Prompt blocks: chained hashes that identify a prefix, for text and for token ids alike.

Block i's hash covers blocks 0..i, so "replica R holds block i" means "R has seen this whole
prefix up to the end of block i". Text is cut every CHARS_PER_BLOCK characters (about 32
tokens of English); token ids every BLOCK_TOKENS. Coarser blocks cost less per decision; 32
tokens still place a 2,000-token prefix hit within 1.5%.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

BLOCK_TOKENS = 32
CHARS_PER_BLOCK = 128  # ≈ 32 tokens at ~4 characters per token


def text_blocks(
    text: str, chars_per_block: int = CHARS_PER_BLOCK, salt: str | None = None
) -> tuple[int, ...]:
    """Chained block hashes of `text`, in `salt`'s namespace (the chain starts from it)."""
    data = text.encode()
    out: list[int] = []
    crc = 0 if salt is None else zlib.crc32(salt.encode())
    for start in range(0, len(data) - chars_per_block + 1, chars_per_block):
        crc = zlib.crc32(data[start : start + chars_per_block], crc)  # chained: covers 0..i
        out.append(
            crc | (len(out) + 1) << 32
        )  # the depth keeps equal CRCs of different lengths apart
    return tuple(out)


def token_blocks(ids: Sequence[int], block_tokens: int = BLOCK_TOKENS) -> tuple[int, ...]:
    out: list[int] = []
    h = 0
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        h = hash((h, tuple(ids[start : start + block_tokens])))
        out.append(h)
    return tuple(out)
