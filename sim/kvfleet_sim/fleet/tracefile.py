"""Production arrival traces in the Azure LLM inference trace schema (the Splitwise paper's
public CSVs): `TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps like
`2023-11-16 18:15:46.6805900`. Each row is one request: when it arrived, its prompt length
and its output length. `time_scale` compresses the clock (2 = twice as fast); `rate_scale`
keeps the clock and multiplies the requests (1.5 = each row once, half of them twice).
"""

from __future__ import annotations

import csv
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from kvfleet_sim.datasets import random_token_ids
from kvfleet_sim.fleet.traces import RateTrace
from kvfleet_sim.fleet.workloads import Arrival, Workload, WorkloadSpec

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceFileError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


@dataclass(frozen=True)
class TraceRow:
    time: float
    """Seconds since the first row."""
    prompt_tokens: int
    output_tokens: int


def _timestamp(text: str) -> float:
    # Seven fractional digits (100 ns ticks): datetime takes at most six.
    head, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}").timestamp()


def read_trace(path: Path, max_prompt_tokens: int | None = None) -> list[TraceRow]:
    try:
        handle = path.open(newline="")
    except OSError as exc:
        raise TraceFileError(f"{path}: cannot read: {exc.strerror}") from exc
    rows: list[TraceRow] = []
    with handle:
        reader = csv.DictReader(handle)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceFileError(f"{path}: missing column(s) {', '.join(missing)}")
        start: float | None = None
        for line, row in enumerate(reader, start=2):
            try:
                t = _timestamp(row["TIMESTAMP"])
                prompt, output = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (TypeError, ValueError) as exc:
                raise TraceFileError(f"{path}:{line}: {exc}") from None
            if prompt < 1 or output < 0:
                raise TraceFileError(f"{path}:{line}: token counts must be positive")
            start = t if start is None else start
            if max_prompt_tokens is not None:
                prompt = min(prompt, max_prompt_tokens)
            rows.append(TraceRow(t - start, prompt, max(1, output)))
    if not rows:
        raise TraceFileError(f"{path}: no requests")
    rows.sort(key=lambda r: r.time)
    return rows


class TraceFileWorkload(Workload):
    """Arrivals replayed from a trace file (random token ids of the given lengths)."""

    def __init__(
        self,
        rows: list[TraceRow],
        vocab_size: int,
        time_scale: float = 1.0,
        rate_scale: float = 1.0,
        seed: int = 1,
    ) -> None:
        if time_scale <= 0 or rate_scale <= 0:
            raise ValueError("time_scale and rate_scale must be > 0")
        super().__init__(
            WorkloadSpec("random", num_requests=len(rows), seed=seed), RateTrace(), vocab_size
        )
        self.rows, self.time_scale, self.rate_scale = rows, time_scale, rate_scale

    @property
    def duration_s(self) -> float:
        return self.rows[-1].time / self.time_scale

    def __iter__(self) -> Iterator[Arrival]:
        rng = random.Random(self.spec.seed)
        whole, frac = int(self.rate_scale), self.rate_scale - int(self.rate_scale)
        for row in self.rows:
            copies = whole + (1 if rng.random() < frac else 0)
            for _ in range(copies):  # copies arrive together: arrivals stay in time order
                yield Arrival(
                    row.time / self.time_scale,
                    random_token_ids(rng, row.prompt_tokens, self.vocab),
                    row.output_tokens,
                )

    def follow_up(self, done: Arrival, output_ids: list[int], now: float) -> Arrival | None:
        return None
