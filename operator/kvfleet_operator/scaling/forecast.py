"""Demand ahead: a short-term forecast of the request rate, and how wrong it has been.

The autoscaler has to order capacity one cold start before it is needed. The rate the
gateways count (requests per second arriving, `kvfleet_gateway_requests_total`) is smoothed
by Holt's linear trend method — a level and a trend, each an exponentially weighted average —
and extrapolated over that horizon. Each forecast is scored when its horizon has passed. The
scores say how much of the extrapolated trend came true (a least-squares weight, 0..1: the
trend of a noisy plateau is noise and is not extrapolated, a ramp's is), and the errors give
the growth the forecast cannot rule out: the warm pool is sized on a high quantile of them.
Of the trend, only its part over the noise of counting Poisson arrivals is extrapolated
(`Forecast.trend_gain`).
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
MIN_SCORED = 4
"""Scored forecasts needed before their errors say anything."""
RISK_QUANTILE = 0.9
"""The under-forecast the warm pool covers: nine in ten of the recent ones."""


def _trend_noise_factor(alpha: float, beta: float) -> float:
    """The variance of Holt's trend, per unit variance of white noise in the observations,
    at a step of 1 s (at a step of `dt` it is this over dt²): the sum of the squares of the
    trend's response to one observation, which decays geometrically (the recursion is
    stable for 0 < alpha, beta < 1)."""
    level = trend = total = 0.0
    for k in range(10_000):
        seen = 1.0 if k == 0 else 0.0
        new_level = alpha * seen + (1 - alpha) * (level + trend)
        trend = beta * (new_level - level) + (1 - beta) * trend
        level = new_level
        total += trend * trend
    return total


TREND_NOISE = _trend_noise_factor(ALPHA, BETA)
"""Holt's trend variance per unit of observation variance, at a 1 s step (`ALPHA`, `BETA`)."""


@dataclass(frozen=True)
class Forecast:
    """Holt's level and trend of the arrival rate, with the forecasts still to be scored."""

    level: float | None = None
    """Smoothed requests per second."""
    trend: float = 0.0
    """Change of the level per second."""
    at: float | None = None
    """When the last observation was folded in."""
    step: float | None = None
    """Seconds between the last two observations (what one rate was counted over)."""
    pending: tuple[tuple[float, float, float], ...] = ()
    """(due time, level then, trend extrapolated over the horizon then, at its gain then) of
    forecasts made one horizon ago, not yet scored."""
    errors: tuple[float, ...] = ()
    """Scored errors, actual − forecast (at the trend weight believed when scored), in
    requests per second (positive: under-forecast)."""
    trend_fit: tuple[tuple[float, float], ...] = ()
    """Scored (actual − level then, trend extrapolated then): how much of the trend came true."""

    def trend_weight(self) -> float:
        """The share of the extrapolated trend that has come true, least squares over the
        scored forecasts, within 0..1 (1 until enough of them say otherwise): a trend that
        kept overshooting — noise read as a ramp — is believed less, a real ramp fully."""
        if len(self.trend_fit) < MIN_SCORED:
            return 1.0
        spread = sum(t * t for _, t in self.trend_fit)
        if spread <= 0.0:
            return 1.0
        return min(1.0, max(0.0, sum(y * t for y, t in self.trend_fit) / spread))

    def trend_gain(self) -> float:
        """The share of the trend that is not counting noise, 0..1. A rate counted over a
        step of `dt` seconds from Poisson arrivals varies by level/dt; through Holt's
        smoothing that is a known variance of the trend (`TREND_NOISE`), and the trend's
        square overstates the true one's by it on average: the gain keeps the part over it
        (a few arrivals a tick make a trend of noise, extrapolated a cold start out, while a
        busy ramp's is kept whole)."""
        if self.level is None or not self.step or self.trend == 0.0:
            return 1.0
        noise = max(0.0, self.level) / self.step * TREND_NOISE / self.step**2
        square = self.trend * self.trend
        if square <= 0.0:  # a trend so small its square underflows: nothing to extrapolate
            return 1.0
        return max(0.0, square - noise) / square

    def ahead(self, horizon_s: float) -> float | None:
        """The rate expected `horizon_s` from the last observation (None: nothing seen)."""
        if self.level is None:
            return None
        extrapolated = self.trend_weight() * self.trend_gain() * self.trend * horizon_s
        return max(0.0, self.level + extrapolated)

    def risk(self) -> float:
        """The under-forecast (requests per second) not ruled out: a high quantile of the
        positive errors seen; 0 with too few of them to say."""
        if len(self.errors) < MIN_SCORED:
            return 0.0
        return _quantile([max(0.0, e) for e in self.errors], RISK_QUANTILE)

    def overshoot(self) -> float:
        """The over-forecast (requests per second) noise alone explains: the same high
        quantile of the negative errors seen (how far under its forecast the rate came in);
        0 with too few of them to say."""
        if len(self.errors) < MIN_SCORED:
            return 0.0
        return _quantile([max(0.0, -e) for e in self.errors], RISK_QUANTILE)

    def noise(self) -> float:
        """How far the rate strays from its forecast either way: the larger of `risk` and
        `overshoot` (noise is symmetric; a plateau that jumps about its mean shows it mostly
        as over-forecasts after each drop)."""
        return max(self.risk(), self.overshoot())


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def observe(f: Forecast, rate: float, now: float, horizon_s: float) -> Forecast:
    """Fold one observed arrival rate in; score the forecasts that fell due; make the next."""
    due = [(level, trend) for t, level, trend in f.pending if t <= now]
    weight = f.trend_weight()
    errors = (*f.errors, *(rate - level - weight * trend for level, trend in due))[-ERRORS_KEPT:]
    fit = (*f.trend_fit, *((rate - level, trend) for level, trend in due))[-ERRORS_KEPT:]
    if f.level is None or f.at is None or now <= f.at:
        level, trend, step = rate, 0.0, f.step
    else:
        step = now - f.at
        predicted = f.level + f.trend * step
        level = ALPHA * rate + (1 - ALPHA) * predicted
        trend = BETA * (level - f.level) / step + (1 - BETA) * f.trend
    new = replace(f, level=level, trend=trend, at=now, step=step, errors=errors, trend_fit=fit)
    made = (now + horizon_s, level, new.trend_gain() * trend * horizon_s)
    return replace(new, pending=(*(p for p in f.pending if p[0] > now), made))


SAMPLES_KEPT = 240
"""Capacity evidence remembered, one sample per tick (an hour at a 15 s tick)."""


@dataclass(frozen=True)
class CapacitySample:
    """One tick's evidence about what a replica serves."""

    rate: float
    """Requests per second per active replica."""
    kept_up: bool | None
    """True: no queue over target and TTFT within the SLO. False: a queue over target and
    still growing (arrivals outran service). None: neither (a backlog draining, a TTFT
    quantile still remembering one) — no evidence either way."""


@dataclass(frozen=True)
class Capacity:
    """Requests per second one replica serves within its targets, learned from the fleet's
    own ticks, in whatever unit binds it (prefill compute, batch slots or KV cache); no
    constant of any model or GPU, and no proxy (the KV usage of a replica at its TTFT limit
    may be a few percent). The boundary is the per-replica rate that best splits the ticks
    the fleet kept up from those where its queue grew past target — the cut with the fewest
    ticks on the wrong side, so a burst that queued at a low rate or a lucky tick at a high
    one is outvoted. The plan reaches `EXPLORE` past the best rate served under the cut (a
    fleet provisioned by it keeps finding where its limit is) and stays a `MARGIN` under
    the first rate that failed over it.

    Exploring up from the rates a fleet has served finds a limit only as fast as load
    happens to push it: a fleet that was always generously sized never learns it may be
    smaller. `ceiling`, the gateways' roofline of one replica at the recent request mix (from
    the prefill rate and decode step they calibrate on every answer), is where the plan
    starts and under which it never goes, unless a rate failed under it: a roofline leaves
    out queueing, so the failures, not the roofline, have the last word."""

    samples: tuple[CapacitySample, ...] = ()
    ceiling: float | None = None
    """Requests per second one replica completes at most (None: no estimate)."""

    @property
    def per_replica(self) -> float | None:
        judged = sorted((s.rate, bool(s.kept_up)) for s in self.samples if s.kept_up is not None)
        cut = _boundary(judged)
        served = [r for r, ok in judged[:cut] if ok]
        failed = [r for r, ok in judged[cut:] if not ok]
        shown = max(served, default=0.0)
        if self.ceiling:
            plan = max(shown * EXPLORE, self.ceiling)
        elif not served:
            # Nothing served well under the cut. A failing rate alone bounds nothing usable:
            # a tick's rate lags the queue it saw (a burst's first seconds), so it can read
            # far lower than what the fleet fell behind at.
            return None
        else:
            plan = shown * EXPLORE
        # Under a rate that failed, but never under one a replica has served while keeping
        # up: that much it demonstrably does.
        return max(shown, min(plan, MARGIN * failed[0])) if failed else plan

    @property
    def bounded(self) -> bool:
        """Whether `per_replica` rests on a limit — the gateways' roofline of a replica (the
        model's config, the GPU's peaks, the engine's KV pool and batch slots) or a rate the
        fleet fell behind at — rather than on the rates it happened to serve, which are a
        floor of what it can: a forecast divided by a floor orders replicas for a trickle."""
        return bool(self.ceiling) or any(s.kept_up is False for s in self.samples)


def _boundary(judged: list[tuple[float, bool]]) -> int:
    """The index into rate-sorted (rate, kept up) ticks where capacity runs out: the cut
    with the fewest failures under it plus successes over it (the highest such cut)."""
    wrong = sum(1 for _, ok in judged if ok)  # the cut at 0: every success is over it
    best, best_wrong = 0, wrong
    for k, (_, ok) in enumerate(judged, start=1):
        wrong += -1 if ok else 1
        if wrong <= best_wrong:
            best, best_wrong = k, wrong
    return best


EXPLORE = 1.15
"""How far past the best rate served well the plan reaches (a first guess is only a floor)."""
MARGIN = 0.9
"""The share of a failing rate the plan stays under."""
MIN_RATE = 0.05
"""A per-replica rate below this says nothing about capacity (an idle fleet)."""


def learn_capacity(
    c: Capacity,
    rate: float | None,
    active: int,
    kept_up: bool | None,
    ceiling: float | None = None,
) -> Capacity:
    """One tick's evidence: `rate` requests per second arrived at `active` replicas (None:
    unknown), and whether the fleet kept up (None: no evidence either way); `ceiling`, the
    gateways' latest roofline of a replica (None: keep the last one)."""
    if ceiling is not None and ceiling > 0:
        c = replace(c, ceiling=ceiling)
    if rate is None or active <= 0 or rate / active < MIN_RATE:
        return c
    return replace(c, samples=(*c.samples, CapacitySample(rate / active, kept_up))[-SAMPLES_KEPT:])
