"""The autoscaling policy: signals in, decision out. Pure: no clock, no I/O, no cluster.

The operator calls `decide` once per tick for each autoscaled InferenceService; the fleet
simulator calls the very same function, so `kvfleet bench autoscale` measures the code that
runs in the operator.

How it decides, HPA-style but on the two signals that matter for LLM serving:

- **Load in replica-equivalents.** KV: the summed `token_usage` of the active replicas over
  the target usage (a sum, not a mean: a replica that just became ready and is still empty
  does not dilute it). Queue: waiting requests plus the gateway's held requests over the
  target queue depth, counted only when the queue per replica is above its target (an empty
  queue says nothing about how few replicas would do) and, with `slo.ttftSeconds`, when its
  wait (waiting over arriving, Little's law) is over half the objective: a queue served
  within it is the next batch forming, not a backlog. Batch slots, when the engine's
  `--max-running-requests` is set: running requests over that many slots per replica at
  the KV target (where slots, not the KV cache, bound a replica, a fleet that is busy
  without a queue must not look idle). The largest wins; within `tolerance` of the current
  size nothing changes.
- **Fast up, slow down.** Per-direction stabilization windows (the spec's): a scale-up takes
  the smallest recommendation of the up window, a scale-down the largest of the down window;
  step limits per tick. Demand that has clearly fallen (for half a down window, by more
  than the forecast's noise: its recent misses either way) takes the fleet down ahead of the
  window, to what its level plus its under-forecasts needs: the window guards noisy
  signals, not a clear fall. A size
  the fleet had to come back to within two down windows (a flap) is a floor for an hour,
  while there is load: an idle fleet goes down as its windows allow.
- **Capacity on the way.** Replicas that are starting are capacity already ordered: while
  any is starting, the queue (which grows because that capacity is late) may not raise the
  target above the size already ordered — no cascade of scale-ups while models load.
- **Demand ahead.** The gateways' arrival rate, forecast one cold start ahead (Holt's
  linear trend, `forecast.py`), over what one replica serves — learned online from the
  ticks the fleet kept up with and those it did not (`forecast.Capacity`), never a
  constant: capacity is ordered before a ramp arrives, and a scale-down waits for the
  forecast too. Only when backed (`forecast_backed`): the capacity rests on a limit (the
  gateways' roofline or a rate that failed), and the rate seen now already loads the fleet.
  Otherwise scaling up waits for evidence the fleet falls behind (queue, KV, slots, an
  objective breached under load): a trickle extrapolated over a cold start is none.
- **The SLO.** With `slo.ttftSeconds`, a TTFT over it adds a replica (unless capacity is
  already starting, or the fleet is idle): the symptom the other terms missed. With
  `slo.itlSeconds`, so does an inter-token latency over it: a decode batch so large that
  every step is slow (the KV cache may still have room), which only more replicas —
  smaller batches — shorten.
- **Missing data, per direction.** An active replica without a fresh scrape counts as
  saturated (its KV full) for scale-up, and blocks scale-down; the decision names it. A
  reader failure, or silence from every replica (a scrape problem, not load), holds the size.
- **Warm pool.** `warmReplicas` loaded spares beside the active ones, inside `maxReplicas`:
  at the top the pool gives way to active replicas. With `warmPool: auto` the pool also
  covers the growth the forecast cannot rule out within a cold start (a high quantile of
  its recent under-forecasts, in replicas), less what the active replicas already hold past
  the forecast: large before a ramp it has been missing, small on a steady night or while a
  down window keeps more active replicas than the forecast needs; and while demand falls
  clearly (the test that takes the fleet down early) and the fleet has shed an active
  replica to the fall, the `warmReplicas` floor is waived — a spare is capacity for growth,
  and an evening's fall has none to cover.

Each decision names the term that bound it (`bound_by`) with its numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from kvfleet_operator.scaling.explain import Terms, explain, explain_falling
from kvfleet_operator.scaling.forecast import MIN_RATE, learn_capacity, observe
from kvfleet_operator.scaling.model import (
    Decision,
    Fleet,
    ScalingConfig,
    Signals,
    State,
)

DRAINING = 0.8
"""A queue below this share of the previous tick's is draining."""
QUEUE_WAIT_SHARE = 0.5
"""The share of the TTFT objective a queue's wait may take before it counts as a backlog
(the rest is the prefill itself)."""
FORECAST_BACKING = 0.5
"""The share of the active replicas' capacity the observed arrival rate must use before the
forecast may order replicas ahead of it: a ramp that has not yet loaded the fleet this far
is a few requests extrapolated over a cold start, not evidence."""
FLAP_MEMORY_S: float = 3600  # an hour
"""How long a flap (down, then back up within two down windows) keeps its size as a floor."""


def shrink_order(in_flight: Sequence[float], created: Sequence[float]) -> list[int]:
    """Replicas (by position) in the order a shrinking fleet takes them out — active ones
    demoted to warm, spares removed: the fewest requests in flight first (what is in flight
    finishes first; an idle one can go at once), then the newest (`created`: larger is
    newer). The operator and the fleet simulator both order by it."""
    return sorted(range(len(in_flight)), key=lambda i: (in_flight[i], -created[i]))


def bounds(config: ScalingConfig, active: int) -> int:
    return max(config.min_replicas, min(config.max_replicas, active))


def warm_for(config: ScalingConfig, active: int) -> int:  # the fixed pool
    return max(0, min(config.warm_replicas, config.max_replicas - active))


def cold_start(config: ScalingConfig, state: State) -> float:
    """The time from a new pod to a ready replica: learned, else the spec's prior."""
    return state.cold_start_s if state.cold_start_s is not None else config.cold_start_s


def forecast_horizon(config: ScalingConfig, state: State) -> float:
    """How far ahead demand is forecast: a replica ordered at the next tick serves a cold
    start after it."""
    return cold_start(config, state) + config.interval_s


def learn_cold_start(config: ScalingConfig, state: State, observed_s: list[float]) -> State:
    """Fold observed pod created → Ready durations into the learned cold start: the mean of
    the observations with the prior counted as two of them (a first fast start does not
    erase a prior of minutes)."""
    if not observed_s:
        return state
    prior_weight = 2
    n = state.cold_start_samples
    mean = cold_start(config, state)
    total = mean * (n + prior_weight) + sum(observed_s)
    n += len(observed_s)
    return replace(state, cold_start_s=total / (n + prior_weight), cold_start_samples=n)


def warm_target(config: ScalingConfig, state: State, active: int, falling: bool = False) -> int:
    """Spares for `active` replicas: the configured floor, and with `warm_auto` the forecast's
    recent under-forecast in replicas — inside `max_replicas`. The under-forecast is growth
    past the forecast: what the active replicas already hold beyond the forecast (a size the
    down window or a flap floor keeps) covers that much of it, and the pool only the rest.
    With `warm_auto`, while demand is `falling` clearly (`_falling_demand`, and the fleet has
    shed an active replica to it) the floor gives way to that term alone: a spare is
    capacity for growth, and a clear fall has none."""
    want = config.warm_replicas
    per = state.capacity.per_replica
    if config.warm_auto and falling:
        want = 0
    if config.warm_auto and per and state.capacity.bounded:
        ahead = state.forecast.ahead(forecast_horizon(config, state)) or 0.0
        slack = max(0.0, active * per - ahead)
        want = max(want, math.ceil((state.forecast.risk() - slack) / per - 1e-9))
    return max(0, min(want, config.max_replicas - active))


def _learn_demand(
    config: ScalingConfig, state: State, fleet: Fleet, signals: Signals, load: float, now: float
) -> State:
    """Fold this tick's arrival rate into the forecast and the learned capacity (and the
    gateways' roofline of a replica, which needs no rate)."""
    rate = signals.arrival_rate
    ceiling = signals.replica_throughput
    if rate is None:
        return replace(state, capacity=learn_capacity(state.capacity, None, 0, None, ceiling))
    forecast = observe(state.forecast, rate, now, forecast_horizon(config, state))
    queue = sum(max(0.0, r.queue) for r in signals.replicas) + max(0.0, signals.held)
    kept_up = _kept_up(config, state, fleet, signals, queue, load)
    capacity = learn_capacity(state.capacity, rate, fleet.active, kept_up, ceiling)
    began = state.falling_since or (now, forecast.level or 0.0)
    falling = None if forecast.trend >= 0 else began
    return replace(state, forecast=forecast, capacity=capacity, falling_since=falling)


def _kept_up(config: ScalingConfig, state: State, fleet: Fleet, signals: Signals,
             queue: float, load: float) -> bool | None:  # fmt: skip
    """Whether this tick shows the fleet keeping up with its arrivals: True (no queue over
    target, TTFT within the SLO, load within the KV and slot targets), False (a queue over
    target that is not draining: arrivals outran service at this rate, whatever the TTFT
    quantile, which lags, says yet; or load over the KV or slot target), None (no evidence:
    a backlog draining, or a TTFT quantile that still remembers one — the KV cache then
    holds what the backlog admitted)."""
    over = backlog(config, signals, queue, fleet.active)
    within_slo = None if not _judged(config, signals) else not _breaches(config, signals)
    if over:
        draining = state.last_queue is not None and queue < state.last_queue
        return None if draining else False
    if within_slo is False:
        # Latency over the objective with no backlog now: the quantile remembers one, and
        # the KV cache (however full) holds the requests that backlog admitted, not this
        # rate's.
        return None
    return load <= max(1, fleet.active)  # over the KV or slot target: failing at this rate


def backlog(config: ScalingConfig, signals: Signals, queue: float, active: int) -> bool:
    """Whether the waiting requests are a backlog: over the target per active replica and,
    with a TTFT objective and a known arrival rate, a wait (by Little's law, waiting over
    arriving) of more than `QUEUE_WAIT_SHARE` of the objective. Under it the queue is the
    next batch forming, served within the objective (requests arrive faster than a step
    admits them), and more replicas would not shorten anyone's wait."""
    if queue <= config.target_queue_depth * max(1, active):
        return False
    rate = signals.arrival_rate
    if config.slo_ttft_s is None or not rate or rate < MIN_RATE:
        return True
    return queue / rate > QUEUE_WAIT_SHARE * config.slo_ttft_s


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


def _terms(config: ScalingConfig, state: State, fleet: Fleet, signals: Signals, now: float,
           current: int) -> Terms:  # fmt: skip
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
    if not backlog(config, signals, queue, fleet.active):
        need_q = 0.0  # a queue served within the SLO says nothing about how few would do
    backlog_draining = draining(state, queue)
    if backlog_draining:
        # A backlog that is draining needs time, not replicas: the capacity that drains it
        # is already serving (ordering for it would overshoot once it is gone).
        need_q = 0.0
    from_zero = fleet.active == 0 and signals.held > 0
    if from_zero:
        need_q = max(1.0, need_q)  # someone is waiting and nothing serves
    cold = cold_start(config, state)
    if fleet.starting > 0 and state.last_up is not None and now - state.last_up < cold:
        # Capacity ordered less than a cold start ago is on the way: the queue grows because
        # it is late, not because more is needed than what was ordered. (Past a cold start,
        # a queue still growing is load still growing: a ramp may order again.)
        need_q = min(need_q, float(max(current, 1)))
    horizon = forecast_horizon(config, state)
    ahead = state.forecast.ahead(horizon)
    per = state.capacity.per_replica
    backed = forecast_backed(state, fleet.active)
    need_f = ahead / per if backed and ahead is not None and per else 0.0
    level = state.forecast.level or 0.0
    need_f_down = max(ahead or 0.0, level) / per if per else 0.0
    # An objective breached while nothing is starting and the fleet is busy: one more
    # replica (what is starting will answer it otherwise; an idle fleet's slow request —
    # a long prompt, a cold path — is not one more replicas shorten).
    busy = queue + running >= max(1, fleet.active)
    one_more = float(current + 1) if fleet.starting == 0 and current > 0 and busy else 0.0
    if backlog_draining:
        one_more = 0.0  # the latencies of a backlog being served, not of what comes now
    over = _breaches(config, signals)
    need_slo = one_more if "slo" in over else 0.0
    need_itl = one_more if "itl" in over else 0.0
    up = {"kv": kv_up, "queue": need_q, "slots": slots, "forecast": need_f, "slo": need_slo,
          "itl": need_itl}  # fmt: skip
    down = max(kv_down / target, need_q, slots, need_f_down, need_slo, need_itl)
    mean_kv = sum(kv) / len(kv) if kv else None
    return Terms(up, down, queue, running, mean_kv, from_zero, ahead, horizon,
                 max(1, fleet.active), backed)  # fmt: skip


def forecast_backed(state: State, active: int) -> bool:
    """Whether the forecast may order capacity ahead of demand: the capacity it divides by
    rests on a limit (`Capacity.bounded`: the roofline the deployment's model, GPU and engine
    limits give, or a rate the fleet fell behind at), and the arrival rate observed now
    already uses `FORECAST_BACKING` of the active replicas' capacity. Otherwise scaling up
    waits for evidence that the fleet falls behind: a queue, KV or slots past their
    targets, an objective breached under load."""
    per, level = state.capacity.per_replica, state.forecast.level
    if not per or level is None or not state.capacity.bounded:
        return False
    return level >= FORECAST_BACKING * max(1, active) * per


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
    falling = (
        _falling_demand(config, state, now) if now - since >= config.scale_down_window_s else None
    )
    early = falling is not None and raw <= falling < desired <= current
    if falling is not None and early:
        # Demand falling with its upper bound inside fewer replicas: the window (which guards
        # noisy signals) need not hold capacity the forecast has ruled out.
        desired = max(falling, current - config.max_step_down, config.min_replicas)
    if signals.missing:
        desired = max(desired, current)  # no evidence that fewer would do
    floor = state.floor if state.floor is not None and now < state.floor[0] else None
    if floor is not None and _idle(signals, terms):
        floor = None  # a floor guards a plateau's noise; with nothing arriving there is none
    if floor is not None and desired < current:
        desired = max(desired, min(current, floor[1]))  # it flapped under this size lately
    bound_by = "forecast" if early else _bound_by(config, terms, need, raw, desired, current)
    changed = desired != current
    per_q = terms.queue / max(1, fleet.active)
    reason = (
        explain_falling(config, state, desired)
        if early
        else explain(config, state, terms, need, raw, desired, current, per_q, bound_by, signals)
    )
    warm = warm_target(config, state, desired, falling=_shed_to_a_fall(state, falling, early))
    if warm < warm_for(config, desired):  # under the floor the fixed pool would keep
        reason += f"; {warm} warm under the floor of {config.warm_replicas} while demand falls"
    decision = Decision(
        desired,
        warm,
        reason,
        queue_per_replica=per_q,
        kv_cache_usage=terms.mean_kv,
        held_requests=signals.held,
        recommendation=raw,
        changed=changed,
        need_kv=terms.up["kv"],
        need_queue=terms.up["queue"],
        bound_by=bound_by,
        forecast_rate=terms.forecast_rate,
        trend_weight=None if terms.forecast_rate is None else state.forecast.trend_weight(),
        capacity_per_replica=state.capacity.per_replica,
        replica_throughput=state.capacity.ceiling,
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


def _shed_to_a_fall(state: State, falling: int | None, early: bool) -> bool:
    """Whether demand is falling clearly (`falling`: `_falling_demand`'s size) and the fleet
    has shed an active replica to this fall (now, `early`, or since it began). A dip on a
    plateau reads as a clear fall for a tick or two and sheds nothing: its spare stays."""
    if falling is None:
        return False
    began, down = state.falling_since, state.last_down
    return early or (began is not None and down is not None and down[0] >= began[0])


def _idle(signals: Signals, terms: Terms) -> bool:
    """Nothing arriving (a known rate under `MIN_RATE`) and nothing waiting: the requests
    still running are the last of a demand that is gone."""
    rate = signals.arrival_rate
    quiet = rate is not None and rate < MIN_RATE
    return quiet and terms.queue <= 0 and signals.held <= 0


def _falling_demand(config: ScalingConfig, state: State, now: float) -> int | None:
    """Replicas enough for demand that has been falling for half a down window, by more than
    the forecast's noise (`Forecast.noise`, its recent misses either way): its level now plus
    its under-forecast, at the learned capacity; None when demand is not falling so, or
    either is unknown. (A dip on a noisy plateau turns the trend for a tick or two and stays
    inside its own noise.)"""
    f, per = state.forecast, state.capacity.per_replica
    began = state.falling_since
    scored = config.scale_down_window_s / config.interval_s  # a window's worth of noise seen
    if f.level is None or not per or began is None or len(f.errors) < scored:
        return None
    if now - began[0] < config.scale_down_window_s / 2 or began[1] - f.level <= f.noise():
        return None
    return max(config.min_replicas, math.ceil((f.level + f.risk()) / per - 1e-9))


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


def _bound_by(config: ScalingConfig, terms: Terms, need: float, raw: int, desired: int,
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
