"""The autoscaling policy: signals in, decision out. Pure: no clock, no I/O, no cluster.

The operator calls `decide` once per tick for each autoscaled InferenceService; the fleet
simulator calls the very same function, so `kvfleet bench autoscale` measures the code that
runs in the operator.

How it decides, HPA-style but on the two signals that matter for LLM serving:

- **Load in replica-equivalents.** KV: the summed `token_usage` of the active replicas over
  the target usage (a sum, not a mean: a replica that just became ready and is still empty
  does not dilute it). Queue: waiting requests plus the gateway's held requests over the
  target queue depth, counted only when the queue per replica is above its target (an empty
  queue says nothing about how few replicas would do). Batch slots, when the engine's
  `--max-running-requests` is set: running requests over that many slots per replica at
  the KV target (where slots, not the KV cache, bound a replica, a fleet that is busy
  without a queue must not look idle). The largest wins; within `tolerance` of the current
  size nothing changes.
- **Fast up, slow down.** Per-direction stabilization windows (the spec's): a scale-up takes
  the smallest recommendation of the up window, a scale-down the largest of the down window;
  step limits per tick.
- **Capacity on the way.** Replicas that are starting are capacity already ordered: while
  any is starting, the queue (which grows because that capacity is late) may not raise the
  target above the size already ordered — no cascade of scale-ups while models load.
- **Demand ahead.** The gateways' arrival rate, forecast one cold start ahead (Holt's
  linear trend, `forecast.py`), over what one replica serves — learned online from the
  ticks the fleet kept up with and those it did not (`forecast.Capacity`), never a
  constant: capacity is ordered before a ramp arrives, and a scale-down waits for the
  forecast too.
- **The SLO.** With `slo.ttftSeconds`, a TTFT over it adds a replica (unless capacity is
  already starting): the symptom the other terms missed. With `slo.itlSeconds`, so does an
  inter-token latency over it: a decode batch so large that every step is slow (the KV
  cache may still have room), which only more replicas — smaller batches — shorten.
- **Missing data, per direction.** An active replica without a fresh scrape counts as
  saturated (its KV full) for scale-up, and blocks scale-down; the decision names it. A
  reader failure, or silence from every replica (a scrape problem, not load), holds the size.
- **Warm pool.** `warmReplicas` loaded spares beside the active ones, inside `maxReplicas`:
  at the top the pool gives way to active replicas. With `warmPool: auto` the pool also
  covers the growth the forecast cannot rule out within a cold start (a high quantile of
  its recent under-forecasts, in replicas): large before a ramp it has been missing, small
  on a steady night.

Each decision names the term that bound it (`bound_by`) with its numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvfleet_kernel.schema import fld
from kvfleet_operator.scaling.forecast import Capacity, Forecast, learn_capacity, observe

DRAINING = 0.8
"""A queue below this share of the previous tick's is draining."""
FLAP_MEMORY_S: float = 3600  # an hour
"""How long a flap (down, then back up within two down windows) keeps its size as a floor."""


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """The bounds and targets of one service (from its spec) and the policy's tuning."""

    min_replicas: int = fld(1, "Fewest active replicas.")
    max_replicas: int = fld(10, "Most replicas, active + warm.")
    warm_replicas: int = fld(0, "Loaded spares kept beside the active ones.")
    target_queue_depth: float = fld(4.0, "Waiting requests per active replica.")
    target_kv_cache_usage: float = fld(0.85, "KV-cache usage per active replica (0..1).")
    max_running_requests: int | None = fld(
        None,
        "Batch slots of one replica (the engine's --max-running-requests); None: unbounded"
        " by slots (the KV cache bounds it). Running requests count against them at the KV"
        " target.",
    )
    scale_up_window_s: float = fld(15.0, "Scale-up stabilization window.")
    scale_down_window_s: float = fld(300.0, "Scale-down stabilization window.")
    cold_start_s: float = fld(300.0, "Prior of the time from a new pod to a ready replica.")
    tolerance: float = fld(0.1, "Relative change below which the size is kept (as HPA's).")
    max_step_up: int = fld(4, "A tick adds at most max(this, the current size) replicas.")
    max_step_down: int = fld(
        2,
        "A tick removes at most this many replicas: one that goes comes back only after a"
        " cold start, and KV usage falls far faster than load as a fleet empties.",
    )
    readiness_grace_s: float = fld(
        60.0, "A replica ready for less than this counts at the target in scale-down sums."
    )
    warm_auto: bool = fld(
        False, "Size the warm pool by forecast risk too (at least warm_replicas)."
    )
    slo_ttft_s: float | None = fld(None, "TTFT objective; over it, one more replica.")
    slo_itl_s: float | None = fld(None, "Inter-token latency objective; over it, one more replica.")
    interval_s: float = fld(15.0, "Seconds between decisions (the forecast's step).")


@dataclass(frozen=True)
class ReplicaSignals:
    """One active replica's engine metrics (`sglang:*` gauges)."""

    pod: str
    queue: float
    """`num_queue_reqs`: requests waiting for admission."""
    running: float
    """`num_running_reqs`."""
    kv_usage: float
    """`token_usage`: used KV over the pool, 0..1."""
    young: bool = False
    """Ready for less than the grace period: its (empty) cache says nothing yet."""


@dataclass(frozen=True)
class Signals:
    """What one tick observed of one service."""

    replicas: tuple[ReplicaSignals, ...] = ()
    """Fresh metrics of active, ready replicas."""
    missing: tuple[str, ...] = ()
    """Active, ready replicas without fresh metrics (stale, not scraped yet, partial)."""
    held: float = 0.0
    """Requests waiting at the gateways: held because no replica can take them (scale from
    zero), or queued because every replica is saturated (fair sharing under overload)."""
    error: str | None = None
    """The reader failed altogether (Prometheus down, gateway unreachable)."""
    arrival_rate: float | None = None
    """Requests per second arriving at the gateways since the last tick (None: unknown)."""
    ttft: float | None = None
    """The TTFT the SLO is judged on (the p99, or the spec's attainment quantile), seconds."""
    itl: float | None = None
    """The inter-token latency the SLO is judged on (the same quantile), seconds."""


@dataclass(frozen=True)
class Fleet:
    """The service's engine pods as the cluster reports them."""

    active: int
    """Ready pods labelled active."""
    warm: int
    """Ready pods labelled warm."""
    starting: int
    """Pods created and not ready yet (younger than `stuck_after` cold starts)."""


@dataclass(frozen=True)
class State:
    """What the policy carries from tick to tick (rebuilt from status after a restart)."""

    desired_active: int | None = None
    history: tuple[tuple[float, int], ...] = ()
    """(time, raw recommendation) within the longer stabilization window."""
    last_change: float | None = None
    cold_start_s: float | None = None
    """Learned from pod created → Ready times; None: the config's prior."""
    cold_start_samples: int = 0
    since: float | None = None
    """When this state began (first tick, operator restart): no scale-down for a whole
    down window after it, for lack of evidence."""
    last_queue: float | None = None
    """Waiting + held requests at the previous tick."""
    last_up: float | None = None
    """When the size last went up."""
    forecast: Forecast = field(default_factory=Forecast)
    capacity: Capacity = field(default_factory=Capacity)
    last_down: tuple[float, int] | None = None
    """(when, the size it went down to) of the last scale-down."""
    floor: tuple[float, int] | None = None
    """(until when, size): a size the fleet went down from and had to come back to soon
    after — no scale-down under it for `FLAP_MEMORY_S` (the load it flapped on is still
    the load)."""


@dataclass(frozen=True)
class Decision:
    desired_active: int
    desired_warm: int
    reason: str
    holding: bool = False
    """The data was missing or failed: the size was held."""
    queue_per_replica: float | None = None
    kv_cache_usage: float | None = None
    """Mean over active replicas with data."""
    held_requests: float = 0.0
    recommendation: int | None = None
    """This tick's raw recommendation before windows and steps."""
    changed: bool = False
    need_kv: float = 0.0
    """Replicas the KV usage asks for (summed usage over the target)."""
    need_queue: float = 0.0
    """Replicas the queue asks for (0 when the queue is under its target)."""
    bound_by: str = "steady"
    """The term that set the size: forecast, queue, kv, slots, slo (TTFT), itl, min, max,
    window, held."""
    forecast_rate: float | None = None
    """Requests per second expected one cold start ahead."""
    capacity_per_replica: float | None = None
    """Requests per second one replica serves at the KV target (learned)."""
    missing: tuple[str, ...] = ()
    """Active replicas without fresh metrics (counted saturated; no scale-down)."""

    @property
    def desired_total(self) -> int:
        return self.desired_active + self.desired_warm


def bounds(config: ScalingConfig, active: int) -> int:
    return max(config.min_replicas, min(config.max_replicas, active))


def warm_for(config: ScalingConfig, active: int) -> int:  # the fixed pool
    return max(0, min(config.warm_replicas, config.max_replicas - active))


def learn_cold_start(config: ScalingConfig, state: State, observed_s: list[float]) -> State:
    """Fold observed pod created → Ready durations into the learned cold start: the mean of
    the observations with the prior counted as two of them (a first fast start does not
    erase a prior of minutes)."""
    if not observed_s:
        return state
    prior_weight = 2
    n = state.cold_start_samples
    mean = state.cold_start_s if state.cold_start_s is not None else config.cold_start_s
    total = mean * (n + prior_weight) + sum(observed_s)
    n += len(observed_s)
    return replace(state, cold_start_s=total / (n + prior_weight), cold_start_samples=n)


def warm_target(config: ScalingConfig, state: State, active: int) -> int:
    """Spares for `active` replicas: the configured floor, and with `warm_auto` the forecast's
    recent under-forecast in replicas — inside `max_replicas`."""
    want = config.warm_replicas
    per = state.capacity.per_replica
    if config.warm_auto and per:
        want = max(want, math.ceil(state.forecast.risk() / per - 1e-9))
    return max(0, min(want, config.max_replicas - active))


def _learn_demand(
    config: ScalingConfig, state: State, fleet: Fleet, signals: Signals, load: float, now: float
) -> State:
    """Fold this tick's arrival rate into the forecast and the learned capacity."""
    rate = signals.arrival_rate
    if rate is None:
        return state
    cold = state.cold_start_s if state.cold_start_s is not None else config.cold_start_s
    forecast = observe(state.forecast, rate, now, cold + config.interval_s)
    queue = sum(max(0.0, r.queue) for r in signals.replicas) + max(0.0, signals.held)
    kept_up = _kept_up(config, state, fleet, signals, queue, load)
    capacity = learn_capacity(state.capacity, rate, fleet.active, kept_up)
    return replace(state, forecast=forecast, capacity=capacity)


def _kept_up(config: ScalingConfig, state: State, fleet: Fleet, signals: Signals,
             queue: float, load: float) -> bool | None:  # fmt: skip
    """Whether this tick shows the fleet keeping up with its arrivals: True (no queue over
    target, TTFT within the SLO), False (load over the KV or slot target, or a queue over
    target that is not draining: arrivals outran service at this rate, whatever the TTFT
    quantile, which lags, says yet), None (no evidence: a backlog draining, or a TTFT
    quantile that still remembers one)."""
    if load > max(1, fleet.active):
        return False  # over the KV or slot target at this rate
    over = queue > config.target_queue_depth * max(1, fleet.active)
    within_slo = None if not _judged(config, signals) else not _breaches(config, signals)
    if over:
        draining = state.last_queue is not None and queue < state.last_queue
        return None if draining else False
    return None if within_slo is False else True


def _breaches(config: ScalingConfig, signals: Signals) -> set[str]:
    """The objectives this tick's latencies exceed: "slo" (TTFT), "itl"."""
    judged = (("slo", config.slo_ttft_s, signals.ttft), ("itl", config.slo_itl_s, signals.itl))
    return {term for term, bound, seen in judged if bound is not None and seen is not None
            and seen > bound}  # fmt: skip


def _judged(config: ScalingConfig, signals: Signals) -> bool:
    """Whether any objective has a latency to be judged on this tick."""
    return (config.slo_ttft_s is not None and signals.ttft is not None) or (
        config.slo_itl_s is not None and signals.itl is not None
    )


def draining(state: State, queue: float) -> bool:
    """Whether the waiting requests are fewer than a tick ago by a clear margin (or gone)."""
    return state.last_queue is not None and queue < DRAINING * state.last_queue


@dataclass(frozen=True)
class _Terms:
    up: dict[str, float]
    """Replicas each term asks for on the way up."""
    down: float
    """Replicas the fleet needs for a scale-down (young replicas at the target)."""
    queue: float
    running: float
    mean_kv: float | None
    from_zero: bool
    forecast_rate: float | None
    serving: int
    """Active replicas (at least 1: what per-replica numbers divide by)."""


def _terms(config: ScalingConfig, state: State, fleet: Fleet, signals: Signals, now: float,
           current: int) -> _Terms:  # fmt: skip
    measured = signals.replicas
    kv = [min(1.0, max(0.0, r.kv_usage)) for r in measured]
    target = config.target_kv_cache_usage
    # A replica without fresh data counts as full (silence under load is not idleness).
    kv_up = (sum(kv) + len(signals.missing)) / target
    # A young replica adds no load (scale-up) and argues for no scale-down (it counts at
    # the target): as HPA treats pods still initializing.
    kv_down = sum(max(k, target) if r.young else k for k, r in zip(kv, measured, strict=True))
    queue = sum(max(0.0, r.queue) for r in measured) + max(0.0, signals.held)
    running = sum(max(0.0, r.running) for r in measured)
    slots = running / (config.max_running_requests * target) if config.max_running_requests else 0
    need_q = queue / config.target_queue_depth
    if queue <= config.target_queue_depth * max(1, fleet.active):
        need_q = 0.0  # an empty queue says nothing about how few replicas would do
    backlog_draining = draining(state, queue)
    if backlog_draining:
        # A backlog that is draining needs time, not replicas: the capacity that drains it
        # is already serving (ordering for it would overshoot once it is gone).
        need_q = 0.0
    from_zero = fleet.active == 0 and signals.held > 0
    if from_zero:
        need_q = max(1.0, need_q)  # someone is waiting and nothing serves
    cold = state.cold_start_s if state.cold_start_s is not None else config.cold_start_s
    if fleet.starting > 0 and state.last_up is not None and now - state.last_up < cold:
        # Capacity ordered less than a cold start ago is on the way: the queue grows because
        # it is late, not because more is needed than what was ordered. (Past a cold start,
        # a queue still growing is load still growing: a ramp may order again.)
        need_q = min(need_q, float(max(current, 1)))
    ahead = state.forecast.ahead(cold + config.interval_s)
    per = state.capacity.per_replica
    need_f = ahead / per if ahead is not None and per else 0.0
    level = state.forecast.level or 0.0
    need_f_down = max(ahead or 0.0, level) / per if per else 0.0
    # An objective breached while nothing is starting: one more replica (what is starting
    # will answer it otherwise).
    one_more = float(current + 1) if fleet.starting == 0 and current > 0 else 0.0
    if backlog_draining:
        one_more = 0.0  # the latencies of a backlog being served, not of what comes now
    over = _breaches(config, signals)
    need_slo = one_more if "slo" in over else 0.0
    need_itl = one_more if "itl" in over else 0.0
    up = {"kv": kv_up, "queue": need_q, "slots": slots, "forecast": need_f, "slo": need_slo,
          "itl": need_itl}  # fmt: skip
    down = max(kv_down / target, need_q, slots, need_f_down, need_slo, need_itl)
    mean_kv = sum(kv) / len(kv) if kv else None
    return _Terms(up, down, queue, running, mean_kv, from_zero, ahead, max(1, fleet.active))


def decide(
    config: ScalingConfig, state: State, fleet: Fleet, signals: Signals, now: float
) -> tuple[Decision, State]:
    current = state.desired_active if state.desired_active is not None else fleet.active
    current = bounds(config, current)
    horizon = max(config.scale_up_window_s, config.scale_down_window_s)
    since = now if state.since is None else state.since
    past = tuple((t, r) for t, r in state.history if now - t < horizon)
    error = signals.error
    if error is None and signals.missing and not signals.replicas:
        # Silence from every replica is a reader's problem (a NetworkPolicy, a scrape
        # config), not load: counting them all full would run the fleet to its maximum.
        error = f"no fresh metrics from any active replica ({', '.join(signals.missing[:3])})"
    if error is not None:
        why = f"holding: {error}"
        decision = Decision(current, warm_target(config, state, current), why, holding=True,
                            bound_by="held")  # fmt: skip
        held = replace(state, desired_active=current, history=(*past, (now, current)), since=since)
        return decision, held
    kv_load = sum(min(1.0, max(0.0, r.kv_usage)) for r in signals.replicas)
    load = kv_load / config.target_kv_cache_usage
    if config.max_running_requests:
        running = sum(max(0.0, r.running) for r in signals.replicas)
        load = max(load, running / (config.max_running_requests * config.target_kv_cache_usage))
    state = _learn_demand(config, state, fleet, signals, load, now)
    terms = _terms(config, state, fleet, signals, now, current)
    need = max(terms.up.values())
    if current == 0 or need > current * (1 + config.tolerance):
        raw = math.ceil(need - 1e-9)
    elif terms.down < current * (1 - config.tolerance) and not signals.missing:
        raw = math.ceil(terms.down - 1e-9)
    else:
        raw = current
    raw = bounds(config, raw)
    history = (*past, (now, raw))
    desired = _stabilized(config, history, current, raw, terms.from_zero, now - since, now)
    if signals.missing:
        desired = max(desired, current)  # no evidence that fewer would do
    floor = state.floor if state.floor is not None and now < state.floor[0] else None
    if floor is not None and desired < current:
        desired = max(desired, min(current, floor[1]))  # it flapped under this size lately
    bound_by = _bound_by(config, terms, need, raw, desired, current)
    changed = desired != current
    per_q = terms.queue / max(1, fleet.active)
    decision = Decision(
        desired,
        warm_target(config, state, desired),
        _explain(config, state, terms, need, raw, desired, current, per_q, bound_by, signals),
        queue_per_replica=per_q,
        kv_cache_usage=terms.mean_kv,
        held_requests=signals.held,
        recommendation=raw,
        changed=changed,
        need_kv=terms.up["kv"],
        need_queue=terms.up["queue"],
        bound_by=bound_by,
        forecast_rate=terms.forecast_rate,
        capacity_per_replica=state.capacity.per_replica,
        missing=signals.missing,
    )
    new_state = replace(
        state,
        floor=_flap_floor(config, state, floor, current, desired, now),
        last_down=(now, desired) if desired < current else state.last_down,
        desired_active=desired,
        history=history,
        since=since,
        last_queue=terms.queue,
        last_up=now if desired > current else state.last_up,
        last_change=now if changed else state.last_change,
    )
    return decision, new_state


def _flap_floor(config: ScalingConfig, state: State, floor: tuple[float, int] | None,
                current: int, desired: int, now: float) -> tuple[float, int] | None:  # fmt: skip
    """A scale-up from the size the last scale-down reached, within two down windows of
    it, is a flap: the size it came back to becomes a floor for `FLAP_MEMORY_S`."""
    down = state.last_down
    if down is None or desired <= current or down[1] != current:
        return floor
    if now - down[0] < 2 * config.scale_down_window_s:
        return (now + FLAP_MEMORY_S, desired)
    return floor


def _stabilized(config: ScalingConfig, history: tuple[tuple[float, int], ...], current: int,
                raw: int, from_zero: bool, evidence_s: float, now: float) -> int:  # fmt: skip
    """HPA's windows and step limits: up takes the smallest recommendation of the up window,
    down the largest of the down window."""
    up = min(r for t, r in history if now - t < config.scale_up_window_s or t == now)
    if from_zero:
        up = raw  # the up window would keep waiting requests waiting on zero capacity
    down = max(r for t, r in history if now - t < config.scale_down_window_s or t == now)
    if evidence_s < config.scale_down_window_s:
        # The size in force counts as recommended while there is less than a window of
        # evidence (a first tick, an operator restart): no premature scale-down.
        down = max(down, current)
    if up > current:
        desired = min(up, current + max(config.max_step_up, current))
    elif down < current:
        desired = max(down, current - config.max_step_down)
    else:
        desired = current
    return bounds(config, desired)


def _bound_by(config: ScalingConfig, terms: _Terms, need: float, raw: int, desired: int,
              current: int) -> str:  # fmt: skip
    """The term that set the size: the largest one on the way up (or `max`), `down` or
    `min` on the way down, `window` while a change waits for its window."""
    top = max(terms.up, key=lambda k: terms.up[k])
    if desired > current:
        return "max" if desired == config.max_replicas and need > desired else top
    if desired < current:
        return "min" if desired == config.min_replicas else "down"
    if raw != desired:
        return "window"
    if desired == config.min_replicas and need <= desired:
        return "min"
    return top if need > 0 else "steady"


def _explain(config: ScalingConfig, state: State, terms: _Terms, need: float, raw: int,
             desired: int, current: int, per_q: float, bound_by: str,
             signals: Signals) -> str:  # fmt: skip
    per = state.capacity.per_replica
    demand = (
        f"forecast {terms.forecast_rate:.1f} req/s in {config.cold_start_s:g}s at {per:.1f}/replica"
        if terms.forecast_rate is not None and per
        else "no demand forecast yet"
    )
    said = {
        "kv": f"KV usage {terms.mean_kv or 0:.2f} over target {config.target_kv_cache_usage:g}",
        "queue": f"queue {per_q:.1f}/replica over target {config.target_queue_depth:g}",
        "slots": f"{terms.running / terms.serving:.1f} running/replica of "
        f"{config.max_running_requests} slots, over target {config.target_kv_cache_usage:g}",
        "forecast": demand,
        "slo": f"TTFT {signals.ttft or 0:.2f}s over the SLO {config.slo_ttft_s or 0:g}s",
        "itl": f"inter-token latency {1000 * (signals.itl or 0):.0f}ms over the SLO"
        f" {1000 * (config.slo_itl_s or 0):g}ms",
    }
    missing = f"; no fresh metrics from {', '.join(sorted(signals.missing)[:3])} (counted full)"
    tail = missing if signals.missing else ""
    if desired > current:
        term = said.get(bound_by, said[max(terms.up, key=lambda k: terms.up[k])])
        return f"scale up to {desired}: {term}{tail}"
    if desired < current:
        return (
            f"scale down to {desired}: load needs {terms.down:.1f} replicas (KV "
            f"{terms.mean_kv or 0:.2f}, queue {per_q:.1f}/replica, {demand}) for "
            f"{config.scale_down_window_s:g}s"
        )
    why = f"steady at {desired}: load needs {need:.1f} replicas ({demand}){tail}"
    if need > desired and desired >= config.max_replicas and bound_by in said:
        why += f" (at the maximum: {said[bound_by]})"  # the term that would have scaled
    if raw > desired:
        why += f" (scale-up to {raw} waiting for its {config.scale_up_window_s:g}s window)"
    elif raw < desired:
        why += f" (scale-down to {raw} waiting for its {config.scale_down_window_s:g}s window)"
    return why
