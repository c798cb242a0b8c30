"""A per-replica circuit breaker: stop sending to a replica that keeps failing, then probe.

closed ──(failure_threshold consecutive failures)──▶ open ──(cooldown)──▶ half-open
half-open lets one request through: success closes the breaker, failure opens it again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

State = Literal["closed", "open", "half_open"]


@dataclass
class Breaker:
    failure_threshold: int = 3
    cooldown_s: float = 5.0
    state: State = "closed"
    failures: int = 0
    opened_at: float = 0.0
    probing: bool = False
    clock: object = field(default=time.monotonic, repr=False)

    def _now(self) -> float:
        return self.clock()  # type: ignore[operator, no-any-return]

    def allows(self) -> bool:
        if self.state == "open" and self._now() - self.opened_at >= self.cooldown_s:
            self.state, self.probing = "half_open", False
        # closed: everything passes; half-open: the single probe; open: nothing
        return self.state == "closed" or (self.state == "half_open" and not self.probing)

    def attempt(self) -> None:
        """A request is being sent (in half-open: the single probe)."""
        if self.state == "half_open":
            self.probing = True

    def success(self) -> None:
        self.state, self.failures, self.probing = "closed", 0, False

    def inconclusive(self) -> None:
        """An accepted request that was slow: latency of accepted work says nothing about the
        replica's health (no failure), but a half-open probe slot is freed for another."""
        self.probing = False

    def failure(self) -> None:
        self.failures += 1
        if self.state == "half_open" or self.failures >= self.failure_threshold:
            self.state, self.opened_at, self.probing = "open", self._now(), False
