"""Fault knobs for reliability tests: misbehave on purpose, predictably, by request number."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FaultPlan:
    """Counts generation requests from 1 in arrival order; `None` disables a fault."""

    fail_nth: int | None = None
    """That request gets HTTP 500 before any byte (upstream error before first byte)."""
    stall_nth: int | None = None
    """That request waits `stall_seconds` before it is scheduled (a hung replica)."""
    stall_seconds: float = 30.0
    drop_nth: int | None = None
    """That streaming request has its connection cut after `drop_after_chunks` chunks."""
    drop_after_chunks: int = 2
    exit_after_chunks: int | None = None
    """The whole process exits abruptly once this many stream chunks were sent (a crash)."""

    @property
    def active(self) -> bool:
        return any(
            v is not None
            for v in (self.fail_nth, self.stall_nth, self.drop_nth, self.exit_after_chunks)
        )


@dataclass
class FaultState:
    plan: FaultPlan
    _counter: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    chunks_sent: int = 0

    def next_request(self) -> int:
        return next(self._counter)
