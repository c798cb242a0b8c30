"""Request length distributions, as SGLang's `bench_serving` / `bench_offline_throughput` draw them.

* `random`: input and output lengths uniform in [len × range_ratio, len] (SGLang's rule).
* `sharegpt`: a ShareGPT-like heavy tail without the download. Lengths are log-normal
  (σ = 1.0 in log space), filtered exactly as SGLang filters the real dataset (both lengths
  ≥ 4, prompt ≤ 1024, prompt + output ≤ 2048). The medians (e^5.125 ≈ 168 in, e^4.78 ≈ 119
  out) are chosen so the filtered means match sglang#1639's 2,000 prompts: 453,502 input and
  376,493 output tokens, i.e. 227 and 188 per request.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

SHAREGPT_LOG_MEDIAN_IN = 5.125
SHAREGPT_LOG_MEDIAN_OUT = 4.78
SHAREGPT_LOG_SIGMA = 1.0
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048


@dataclass(frozen=True)
class LengthPair:
    input_len: int
    output_len: int


def random_lengths(
    rng: random.Random, n: int, input_len: int, output_len: int, range_ratio: float = 1.0
) -> list[LengthPair]:
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError("range_ratio must be in [0, 1]")
    lo_in = max(1, int(input_len * range_ratio))
    lo_out = max(1, int(output_len * range_ratio))
    return [
        LengthPair(rng.randint(lo_in, input_len), rng.randint(lo_out, output_len)) for _ in range(n)
    ]


def sharegpt_lengths(rng: random.Random, n: int) -> list[LengthPair]:
    out: list[LengthPair] = []
    while len(out) < n:
        i = round(math.exp(rng.gauss(SHAREGPT_LOG_MEDIAN_IN, SHAREGPT_LOG_SIGMA)))
        o = round(math.exp(rng.gauss(SHAREGPT_LOG_MEDIAN_OUT, SHAREGPT_LOG_SIGMA)))
        if i < 4 or o < 4 or i > SHAREGPT_MAX_PROMPT or i + o > SHAREGPT_MAX_TOTAL:
            continue
        out.append(LengthPair(i, o))
    return out


def random_token_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    r = rng.random
    return [int(r() * vocab_size) for _ in range(n)]
