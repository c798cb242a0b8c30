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
from pathlib import Path

from tokenizers import Tokenizer as HfTokenizerFile

TOKENIZER_FILE = "tokenizer.json"

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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
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


class HfTokenizer(Tokenizer):
    """A model's own Hugging Face `tokenizer.json` (`--tokenizer-path`) for prompts, so token
    ids (and the KV-event page hashes built from them) are the real engine's. Generated text
    is still the stand-in's words, each mapped to its id in this vocabulary (words that are
    not one token there are not generated). Chat is rendered in Llama 3's format
    (`api.render_chat`) whatever the model's own template is."""

    def __init__(self, hf: HfTokenizerFile) -> None:
        self._hf = hf
        super().__init__(hf.get_vocab_size())
        pairs = [(w, hf.encode(w, add_special_tokens=False).ids) for w in self._words]
        single = [(w, ids[0]) for w, ids in pairs if len(ids) == 1]
        if not single:
            raise ValueError("the tokenizer has no single-token words to generate from")
        self._words = [w for w, _ in single]
        self._word_ids = [i for _, i in single]
        self._pieces_by_id = dict(zip(self._word_ids, self._words, strict=True))

    @classmethod
    def load(cls, directory: str) -> HfTokenizer:
        # Read in Python, parsed from text: the file may sit on any mounted volume.
        return cls(HfTokenizerFile.from_str((Path(directory) / TOKENIZER_FILE).read_text()))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def count(self, text: str) -> int:
        return len(self.encode(text))
