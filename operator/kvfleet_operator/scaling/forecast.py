"""Demand ahead: a short-term forecast of the request rate, and how wrong it has been.

The autoscaler has to order capacity one cold start before it is needed. The rate the
gateways count (requests per second arriving, `kvfleet_gateway_requests_total`) is smoothed
by Holt's linear trend method — a level and a trend, each an exponentially weighted average —
and extrapolated over that horizon. The forecast's own errors, scored when the horizon has
passed, give the growth it cannot rule out: the warm pool is sized on a high quantile of them.
Pure functions over frozen state; no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

ALPHA = 0.5
"""Weight of a new observation in the level (per tick): half the level is the last tick's."""
BETA = 0.2
"""Weight of a new level change in the trend: a trend needs a few ticks to be believed."""
ERRORS_KEPT = 60
"""Scored forecast errors remembered (15 minutes at a 15 s tick)."""
RISK_QUANTILE = 0.9
"""The under-forecast the warm pool covers: nine in ten of the recent ones."""


@dataclass(frozen=True)
class Forecast:
    """Holt's level and trend of the arrival rate, with the forecasts still to be scored."""

    level: float | None = None
    """Smoothed requests per second."""
    trend: float = 0.0
    """Change of the level per second."""
    at: float | None = None
    """When the last observation was folded in."""
    pending: tuple[tuple[float, float], ...] = ()
    """(due time, forecast rate) of forecasts made one horizon ago, not yet scored."""
    errors: tuple[float, ...] = ()
    """Scored errors, actual − forecast, in requests per second (positive: under-forecast)."""

    def ahead(self, horizon_s: float) -> float | None:
        """The rate expected `horizon_s` from the last observation (None: nothing seen)."""
        if self.level is None:
            return None
        return max(0.0, self.level + self.trend * horizon_s)

    def risk(self) -> float:
        """The under-forecast (requests per second) not ruled out: a high quantile of the
        positive errors seen; 0 with too few of them to say."""
        if len(self.errors) < 4:
            return 0.0
        ordered = sorted(max(0.0, e) for e in self.errors)
        return ordered[min(len(ordered) - 1, math.ceil(RISK_QUANTILE * len(ordered)) - 1)]


def observe(f: Forecast, rate: float, now: float, horizon_s: float) -> Forecast:
    """Fold one observed arrival rate in; score the forecasts that fell due; make the next."""
    due = [(t, p) for t, p in f.pending if t <= now]
    errors = (*f.errors, *(rate - p for _, p in due))[-ERRORS_KEPT:]
    if f.level is None or f.at is None or now <= f.at:
        level, trend = rate, 0.0
    else:
        dt = now - f.at
        predicted = f.level + f.trend * dt
        level = ALPHA * rate + (1 - ALPHA) * predicted
        trend = BETA * (level - f.level) / dt + (1 - BETA) * f.trend
    new = replace(f, level=level, trend=trend, at=now, errors=errors)
    ahead = new.ahead(horizon_s)
    pending = tuple((t, p) for t, p in f.pending if t > now)
    if ahead is not None:
        pending = (*pending, (now + horizon_s, ahead))
    return replace(new, pending=pending)


SAMPLES_KEPT = 240
"""Capacity evidence remembered, one sample per tick (an hour at a 15 s tick)."""


@dataclass(frozen=True)
class Capacity:
    """Requests per second one replica serves within its targets, learned from the fleet's
    own ticks: each is a per-replica rate (arrivals over active replicas) and whether the
    fleet kept up (no queue over target, TTFT within the SLO when one is set). The estimate
    is the highest rate served well, capped by the lowest rate that was not — the boundary
    the fleet has actually shown, in whatever unit binds it (prefill compute, batch slots or
    KV cache); no constant of any model or GPU."""

    samples: tuple[tuple[float, bool], ...] = ()

    @property
    def per_replica(self) -> float | None:
        """The rate to plan with: up to `EXPLORE` above the best rate served well, so a
        fleet provisioned by it keeps finding where its limit is, and never past (a margin
        under) the rates at which it fell behind."""
        served = [r for r, ok in self.samples if ok]
        if not served:
            return None
        plan = max(served) * EXPLORE
        over = sorted(r for r, ok in self.samples if not ok)
        if over:  # a robust low rate among the failures: one noisy tick does not set it
            plan = min(plan, MARGIN * over[len(over) // 5])
        return plan


EXPLORE = 1.15
"""How far past the best rate served well the plan reaches (a first guess is only a floor)."""
MARGIN = 0.9
"""The share of a failing rate the plan stays under."""


MIN_RATE = 0.05
"""A per-replica rate below this says nothing about capacity (an idle fleet)."""


def learn_capacity(c: Capacity, rate: float, active: int, kept_up: bool) -> Capacity:
    """One tick's evidence: `rate` requests per second arrived at `active` replicas, and the
    fleet `kept_up` or not."""
    if active <= 0 or rate / active < MIN_RATE:
        return c
    return Capacity((*c.samples, (rate / active, kept_up))[-SAMPLES_KEPT:])
