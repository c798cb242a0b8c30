"""The words of an autoscaling decision: which term bound it, with its numbers, as
`kubectl describe` and the ScaledUp/ScaledDown Events show them."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_operator.scaling.model import ScalingConfig, Signals, State


@dataclass(frozen=True)
class Terms:
    """What each term of one tick asks for (`policy.decide` computes it)."""

    up: dict[str, float]
    """Replicas each term asks for on the way up."""
    down: float
    """Replicas the fleet needs for a scale-down (young replicas at the target)."""
    queue: float
    running: float
    mean_kv: float | None
    from_zero: bool
    forecast_rate: float | None
    """Requests per second forecast `horizon_s` ahead."""
    horizon_s: float
    """How far ahead the forecast looks: the cold start (learned, else the spec's prior) and
    a tick."""
    serving: int
    """Active replicas (at least 1: what per-replica numbers divide by)."""
    forecast_backed: bool = True
    """Whether the forecast may order capacity (`policy.forecast_backed`)."""


def explain(config: ScalingConfig, state: State, terms: Terms, need: float, raw: int,
             desired: int, current: int, per_q: float, bound_by: str,
             signals: Signals) -> str:  # fmt: skip
    per = state.capacity.per_replica
    demand = (
        f"forecast {terms.forecast_rate:.1f} req/s in {terms.horizon_s:.0f}s at {per:.1f}/replica"
        if terms.forecast_rate is not None and per
        else "no demand forecast yet"
    )
    if terms.forecast_rate is not None and per and not terms.forecast_backed:
        demand += ", not acted on: the load seen is no evidence the fleet falls behind"
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


def explain_falling(config: ScalingConfig, state: State, desired: int) -> str:
    f, per, began = state.forecast, state.capacity.per_replica or 0.0, state.falling_since
    level, risk, noise = f.level or 0.0, f.risk(), f.noise()
    fell = (began[1] - level) if began else 0.0
    return (
        f"scale down to {desired}: demand falling ({level:.1f} req/s, {fell:.1f} under where"
        f" it began to fall, more than the forecast's noise of {noise:.1f}); {level:.1f}"
        f" + {risk:.1f} req/s at {per:.1f}/replica, ahead of the {config.scale_down_window_s:g}s"
        " window"
    )
