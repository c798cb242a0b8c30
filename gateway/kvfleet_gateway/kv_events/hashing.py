"""The block hashes SGLang publishes, computed from a prompt's token ids.

SGLang (sglang/srt/mem_cache: `get_hash_str` → the native `hash_binding.cpp`, then
`hash_str_to_int64`) names page i of a cached sequence by SHA-256 over page i-1's digest
(none for the first page) followed by page i's token ids as little-endian uint32; the
published hash is the digest's first 8 bytes as a big-endian signed int64. A page is
`block_size` tokens, the engine's `--page-size`, advertised in /server_info. Only whole pages
are cached, so a prompt's trailing partial page has no hash.

A request with a cache salt is cached in a namespace of its own: its first page chains from
SHA-256 of `sglang-cache-salt-v1`, a NUL and the salt instead of from nothing (SGLang's
`compute_node_event_hash_values`), so the same prompt under two salts shares no page.
Requests with a LoRA adapter are not indexed (they fall back to the approximate index).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

_U32_MAX = 2**32 - 1


def salt_seed(salt: str) -> bytes:
    return hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest()


def page_hashes(
    token_ids: Sequence[int], block_size: int, salt: str | None = None
) -> tuple[int, ...]:
    """One hash per whole page of `token_ids` (tokens beyond the last whole page: none), in
    `salt`'s namespace."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    whole = len(token_ids) - len(token_ids) % block_size
    if not whole:
        return ()
    words = array("I", token_ids[:whole])  # ids above uint32 raise here (OverflowError)
    if sys.byteorder != "little":
        words.byteswap()
    raw = memoryview(words).cast("B")
    step = block_size * 4
    out: list[int] = []
    prior = b"" if salt is None else salt_seed(salt)
    sha = hashlib.sha256
    for start in range(0, whole * 4, step):
        prior = sha(prior + raw[start : start + step]).digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return tuple(out)
