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
- **Missing data holds.** No fresh signal from an active replica, or a reader failure: the
  size is held, never moved toward the minimum; the decision says why.
- **Warm pool.** `warmReplicas` loaded spares beside the active ones, inside `maxReplicas`:
  at the top the pool gives way to active replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvfleet_kernel.schema import fld

DRAINING = 0.8
"""A queue below this share of the previous tick's is draining."""


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
        1,
        "A tick removes at most this many replicas: one that goes comes back only after a"
        " cold start, and KV usage falls far faster than load as a fleet empties.",
    )
    readiness_grace_s: float = fld(
        60.0, "A replica ready for less than this counts at the target in scale-down sums."
    )


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
    """Requests the gateway holds because no replica can take them (scale from zero)."""
    error: str | None = None
    """The reader failed altogether (Prometheus down, gateway unreachable)."""


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

    @property
    def desired_total(self) -> int:
        return self.desired_active + self.desired_warm


def bounds(config: ScalingConfig, active: int) -> int:
    return max(config.min_replicas, min(config.max_replicas, active))


def warm_for(config: ScalingConfig, active: int) -> int:
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


def decide(
    config: ScalingConfig, state: State, fleet: Fleet, signals: Signals, now: float
) -> tuple[Decision, State]:
    current = state.desired_active if state.desired_active is not None else fleet.active
    current = bounds(config, current)
    horizon = max(config.scale_up_window_s, config.scale_down_window_s)
    since = now if state.since is None else state.since
    past = tuple((t, r) for t, r in state.history if now - t < horizon)
    if signals.error is not None or signals.missing:
        why = signals.error or f"no fresh metrics from {', '.join(sorted(signals.missing)[:3])}"
        decision = Decision(current, warm_for(config, current), f"holding: {why}", holding=True)
        held = replace(state, desired_active=current, history=(*past, (now, current)), since=since)
        return decision, held

    measured = signals.replicas
    kv = [min(1.0, max(0.0, r.kv_usage)) for r in measured]
    kv_sum = sum(kv)
    # A young replica adds no load (scale-up) and argues for no scale-down (it counts at
    # the target): as HPA treats pods still initializing.
    kv_sum_down = sum(
        max(k, config.target_kv_cache_usage) if r.young else k
        for k, r in zip(kv, measured, strict=True)
    )
    queue = sum(max(0.0, r.queue) for r in measured) + max(0.0, signals.held)
    serving = max(1, fleet.active)
    need_kv = kv_sum / config.target_kv_cache_usage
    running = sum(max(0.0, r.running) for r in measured)
    need_slots = 0.0
    if config.max_running_requests:
        need_slots = running / (config.max_running_requests * config.target_kv_cache_usage)
    need_q = queue / config.target_queue_depth if queue > config.target_queue_depth * serving else 0
    if state.last_queue is not None and queue < DRAINING * state.last_queue:
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
    need = max(need_kv, need_q, need_slots)
    need_down = max(kv_sum_down / config.target_kv_cache_usage, need_q, need_slots)
    if current == 0 or need > current * (1 + config.tolerance):
        raw = math.ceil(need - 1e-9)
    elif need_down < current * (1 - config.tolerance):
        raw = math.ceil(need_down - 1e-9)
    else:
        raw = current
    raw = bounds(config, raw)

    history = (*past, (now, raw))
    up = min(r for t, r in history if now - t < config.scale_up_window_s or t == now)
    if from_zero:
        up = raw  # the up window would keep waiting requests waiting on zero capacity
    down = max(r for t, r in history if now - t < config.scale_down_window_s or t == now)
    if now - since < config.scale_down_window_s:
        # The size in force counts as recommended while there is less than a window of
        # evidence (a first tick, an operator restart): no premature scale-down.
        down = max(down, current)
    if up > current:
        desired = min(up, current + max(config.max_step_up, current))
    elif down < current:
        desired = max(down, current - config.max_step_down)
    else:
        desired = current
    desired = bounds(config, desired)

    mean_kv = kv_sum / len(measured) if measured else None
    per_q = queue / serving
    if desired > current:
        if need_q >= max(need_kv, need_slots):
            why = (
                f"scale up to {desired}: queue {per_q:.1f}/replica over target "
                f"{config.target_queue_depth:g}"
            )
        elif need_slots > need_kv:
            why = (
                f"scale up to {desired}: {running / serving:.1f} running/replica of "
                f"{config.max_running_requests} slots, over target {config.target_kv_cache_usage:g}"
            )
        else:
            why = (
                f"scale up to {desired}: KV usage {mean_kv or 0:.2f} over target "
                f"{config.target_kv_cache_usage:g}"
            )
    elif desired < current:
        why = (
            f"scale down to {desired}: load needs {need:.1f} replicas "
            f"(KV {mean_kv or 0:.2f}, queue {per_q:.1f}/replica, {running:g} running) for "
            f"{config.scale_down_window_s:g}s"
        )
    else:
        why = f"steady at {desired}: load needs {need:.1f} replicas"
        if raw > desired:
            why += f" (scale-up to {raw} waiting for its {config.scale_up_window_s:g}s window)"
        elif raw < desired:
            why += f" (scale-down to {raw} waiting for its {config.scale_down_window_s:g}s window)"
    changed = desired != current
    decision = Decision(
        desired,
        warm_for(config, desired),
        why,
        queue_per_replica=per_q,
        kv_cache_usage=mean_kv,
        held_requests=signals.held,
        recommendation=raw,
        changed=changed,
        need_kv=need_kv,
        need_queue=need_q,
    )
    new_state = replace(
        state,
        desired_active=desired,
        history=history,
        since=since,
        last_queue=queue,
        last_up=now if desired > current else state.last_up,
        last_change=now if changed else state.last_change,
    )
    return decision, new_state
