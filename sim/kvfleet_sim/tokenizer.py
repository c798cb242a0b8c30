"""A deterministic, download-free stand-in for a BPE tokenizer.

Text splits into pieces of leading whitespace plus up to four non-space characters (English
averages about four characters per token, as with Llama-3's tokenizer). Ids are CRC32 of the
piece modulo the vocabulary, so they are stable across processes and machines. Splitting is
left to right, so a shared text prefix gives a shared token prefix (all but possibly the
last, cut piece), which is the property prefix caching and cache-aware routing rely on.

Generated text is built from whole pieces (" word" with words of at most four letters), so
re-tokenising a reply reproduces exactly the ids the engine generated: a multi-turn
conversation hits the cache on its own history, as it does with a real tokenizer.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Iterator
from functools import lru_cache

# Special tokens (`<|eot_id|>`) are one token each, as in every real chat tokenizer.
_PIECE = re.compile(r"<\|[a-z_]+\|>|\s*(?:(?!<\|)\S){1,4}|\s+")

# Words of at most four letters: each " word" is exactly one piece.
_WORDS = (
    "the of and to in is it you that he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an "
    "each she do how their if will up out many then them so some her would make like him "
    "into time has look two more go see no way could my than been call who its now find "
    "long down day did get come made may part over new take only home us know year live "
    "give most very good name just form much such turn mean move same tell does set want "
    "air well also play small end put read hand large add even land here must big high "
    "act why ask men went need try kind off line farm page grow four mile fast self cold "
).split()


class Tokenizer:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._id = lru_cache(maxsize=65536)(self._piece_id)
        self._words = [f" {w}" for w in dict.fromkeys(_WORDS) if len(w) <= 4]
        self._word_ids = [self._piece_id(p) for p in self._words]
        self._pieces_by_id: dict[int, str] = dict(zip(self._word_ids, self._words, strict=True))

    def _piece_id(self, piece: str) -> int:
        return zlib.crc32(piece.encode()) % self.vocab_size

    def encode(self, text: str) -> list[int]:
        ident = self._id
        return [ident(p) for p in _PIECE.findall(text)]

    def count(self, text: str) -> int:
        return len(_PIECE.findall(text))

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids (only ids this tokenizer generated are known)."""
        pieces = self._pieces_by_id
        return "".join(pieces.get(i, " ?") for i in ids)

    def generate(self, seed: int) -> Iterator[int]:
        """An endless, seed-determined stream of generated token ids."""
        rng = random.Random(seed)
        ids, n = self._word_ids, len(self._word_ids)
        while True:
            yield ids[int(rng.random() * n)]

    def generate_ids(self, seed: int, count: int) -> list[int]:
        rng = random.Random(seed)
        ids, n, r = self._word_ids, len(self._word_ids), rng.random
        return [ids[int(r() * n)] for _ in range(count)]
