"""Production arrival traces, in the two public formats users have:

* the Azure LLM inference trace schema (the Splitwise paper's CSVs):
  `TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps like `2023-11-16 18:15:46.6805900`;
* Mooncake's trace (JSON Lines, `*.jsonl`): `timestamp` in milliseconds, `input_length`,
  `output_length`, and `hash_ids` — one id per 512-token block of the prompt, equal ids
  meaning the same tokens, so the prefix reuse the trace recorded is replayed: requests that
  share leading ids share those blocks' tokens exactly, and a prefix cache finds them.

Each row is one request: when it arrived, its prompt and its output length. `time_scale`
compresses the clock (2 = twice as fast); `rate_scale`
keeps the clock and multiplies the requests (1.5 = each row once, half of them twice), each
copy a population of its own (its prefix blocks shared within it, not with other copies),
spread over the gap to the next row rather than sent at one instant.
"""

from __future__ import annotations

import csv
import json
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
    hash_ids: tuple[int, ...] = ()
    """Mooncake: the prompt's 512-token blocks by content id (empty: unrelated tokens)."""


MOONCAKE_BLOCK = 512


def azure_timestamp(text: str) -> float:
    # Seven fractional digits (100 ns ticks): datetime takes at most six.
    head, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}").timestamp()


def read_trace(path: Path, max_prompt_tokens: int | None = None) -> list[TraceRow]:
    """The rows of an Azure CSV or (by its `.jsonl` suffix) a Mooncake trace, time-ordered."""
    if path.suffix == ".jsonl":
        return _read_mooncake(path, max_prompt_tokens)
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
                t = azure_timestamp(row["TIMESTAMP"])
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


def _read_mooncake(path: Path, max_prompt_tokens: int | None) -> list[TraceRow]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceFileError(f"{path}: cannot read: {exc.strerror}") from exc
    rows: list[TraceRow] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            t, prompt = float(doc["timestamp"]) / 1000.0, int(doc["input_length"])
            output, ids = int(doc["output_length"]), tuple(int(h) for h in doc.get("hash_ids", ()))
        except (ValueError, TypeError, KeyError) as exc:
            raise TraceFileError(f"{path}:{n}: {type(exc).__name__}: {exc}") from None
        if prompt < 1 or output < 0:
            raise TraceFileError(f"{path}:{n}: token counts must be positive")
        if max_prompt_tokens is not None and prompt > max_prompt_tokens:
            prompt = max_prompt_tokens
            ids = ids[: -(-prompt // MOONCAKE_BLOCK)]
        rows.append(TraceRow(t, prompt, max(1, output), ids))
    if not rows:
        raise TraceFileError(f"{path}: no requests")
    rows.sort(key=lambda r: r.time)
    start = rows[0].time
    return [TraceRow(r.time - start, r.prompt_tokens, r.output_tokens, r.hash_ids) for r in rows]


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
        self._blocks: dict[tuple[int, int], list[int]] = {}

    @property
    def duration_s(self) -> float:
        return self.rows[-1].time / self.time_scale

    def __iter__(self) -> Iterator[Arrival]:
        rng = random.Random(self.spec.seed)
        spread = random.Random(f"spread:{self.spec.seed}")  # the prompts' draws stay as they were
        whole, frac = int(self.rate_scale), self.rate_scale - int(self.rate_scale)
        nexts = [r.time for r in self.rows[1:]] + [self.rows[-1].time]
        for row, next_time in zip(self.rows, nexts, strict=True):
            copies = whole + (1 if rng.random() < frac else 0)
            for copy, at in enumerate(self._copy_times(row.time, next_time, copies, spread)):
                prompt = self._prompt(row, rng, copy)
                yield Arrival(at / self.time_scale, prompt, row.output_tokens)

    @staticmethod
    def _copy_times(time: float, next_time: float, copies: int,
                    spread: random.Random) -> list[float]:  # fmt: skip
        """When a row's copies arrive: the first at the row's time, the others spread
        uniformly until the next row's, in order. Copies sent at one instant would make
        every arrival a batch of `rate_scale` requests — a burstier load than the same rate
        from independent clients — while spread within the gap the scaled rate keeps the
        file's shape over any span longer than its gaps (and arrivals stay in time order)."""
        if copies <= 0:
            return []
        gap = max(0.0, next_time - time)
        return [time, *sorted(time + spread.random() * gap for _ in range(copies - 1))]

    def _prompt(self, row: TraceRow, rng: random.Random, copy: int = 0) -> list[int]:
        """The row's prompt; `copy` numbers the copies `rate_scale` makes. Each copy is a
        population of its own: copy k's requests share prefix blocks with each other as the
        trace's do, and none with another copy's (eight copies of one request sent at once
        sharing every block would make the scaled load mostly prefix-cache hits)."""
        if not row.hash_ids:
            return random_token_ids(rng, row.prompt_tokens, self.vocab)
        ids: list[int] = []
        for h in row.hash_ids:  # the same id, the same tokens: a prefix cache finds them
            block = self._blocks.get((copy, h))
            if block is None:
                seed: int | str = h if copy == 0 else f"{copy}:{h}"
                block = random_token_ids(random.Random(seed), MOONCAKE_BLOCK, self.vocab)
                self._blocks[(copy, h)] = block
            ids += block
        if len(ids) < row.prompt_tokens:
            ids += random_token_ids(rng, row.prompt_tokens - len(ids), self.vocab)
        return ids[: row.prompt_tokens]

    def follow_up(self, done: Arrival, output_ids: list[int], now: float) -> Arrival | None:
        return None
