"""Arrival-time traces: when requests arrive, independent of what they ask for."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

TraceKind = Literal["poisson", "all-at-once", "step", "ramp", "bursts", "diurnal", "flash"]


@dataclass(frozen=True)
class RateTrace:
    """A request rate over time (req/s), sampled as an inhomogeneous Poisson process."""

    kind: TraceKind = "poisson"
    rate: float = 10.0
    """Base rate (poisson, and before/after a step; start of a ramp; mean rate of bursts)."""
    peak_rate: float = 30.0
    """Rate during a step spike, or at the end of a ramp."""
    start_s: float = 30.0
    """When the step spike begins."""
    duration_s: float = 30.0
    """How long the step spike (or the ramp) lasts."""
    burst_period_s: float = 10.0
    """Bursts: one period is a short on-phase at high rate followed by silence."""
    burst_duty: float = 0.2
    """Share of each period that is on (the mean rate is kept at `rate`)."""
    period_s: float = 900.0
    """Diurnal: one day compressed into this many seconds (trough at 0, peak at half)."""
    decay_s: float = 120.0
    """Flash crowd: how fast the spike above `rate` decays (exponential time constant)."""

    def rate_at(self, t: float) -> float:
        if self.kind == "poisson":
            return self.rate
        if self.kind == "step":
            return (
                self.peak_rate if self.start_s <= t < self.start_s + self.duration_s else self.rate
            )
        if self.kind == "ramp":
            f = min(1.0, max(0.0, t / self.duration_s))
            return self.rate + (self.peak_rate - self.rate) * f
        if self.kind == "bursts":
            phase = (t % self.burst_period_s) / self.burst_period_s
            return self.rate / self.burst_duty if phase < self.burst_duty else 0.0
        if self.kind == "diurnal":  # from `rate` at night to `peak_rate` at noon
            f = 0.5 - 0.5 * math.cos(2 * math.pi * t / self.period_s)
            return self.rate + (self.peak_rate - self.rate) * f
        if self.kind == "flash":  # a crowd arrives at once, then thins out
            if t < self.start_s:
                return self.rate
            return self.rate + (self.peak_rate - self.rate) * math.exp(
                -(t - self.start_s) / self.decay_s
            )
        return math.inf

    def expected_requests(self, duration_s: float, dt: float = 1.0) -> int:
        """Requests the trace sends in `duration_s` (its rate integrated)."""
        steps = max(1, int(duration_s / dt))
        return int(sum(self.rate_at((i + 0.5) * dt) * dt for i in range(steps)))

    def max_rate(self) -> float:
        if self.kind == "bursts":
            return self.rate / self.burst_duty
        if self.kind in ("step", "ramp", "diurnal", "flash"):
            return max(self.rate, self.peak_rate)
        return self.rate

    def arrivals(self, n: int, rng: random.Random) -> list[float]:
        """`n` arrival times by thinning (exact for piecewise and linear rates)."""
        if self.kind == "all-at-once":
            return [0.0] * n
        if self.max_rate() <= 0:
            raise ValueError("the trace's rate must be positive")
        return thinned(self.rate_at, self.max_rate(), n, rng)


def thinned(
    rate_at: Callable[[float], float], peak: float, n: int, rng: random.Random
) -> list[float]:
    """`n` arrival times of a Poisson process of rate `rate_at(t)` ≤ `peak` (thinning)."""
    out: list[float] = []
    t = 0.0
    while len(out) < n:
        t += rng.expovariate(peak)
        if rng.random() * peak <= rate_at(t):
            out.append(t)
    return out
