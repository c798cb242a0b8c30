"""The autoscaler's tick: read every autoscaled service's pods and signals, decide, and hand
the decisions to the reconcile that applies them. Thin I/O around the pure policy.

Each tick costs one pod list per service (engines and gateway, one selector) and one read
of the signals for all services together (a few Prometheus queries, or the pods' /metrics).
A decision is kept in memory per service; the reconcile reads it (replicas, roles, status),
so the operator has one writer of the engine Deployment and of the status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvfleet_kernel.schema import Json, to_json
from kvfleet_operator.kube import POD, Kube
from kvfleet_operator.render.common import (
    ENGINE,
    GATEWAY,
    ISVC_LABEL,
    PREFILL,
    is_group_worker,
)
from kvfleet_operator.scaling.model import Decision, Fleet, ScalingConfig, State
from kvfleet_operator.scaling.observe import (
    Demand,
    DirectReader,
    Key,
    Observation,
    PrometheusReader,
    ServicePods,
    parse_time,
    quantile,
    ready_since,
    role_of,
    signals_for,
)
from kvfleet_operator.scaling.policy import cold_start, decide, learn_cold_start
from kvfleet_operator.spec import InferenceServiceSpec, parse_spec
from kvfleet_operator.spec_scaling import Autoscaling
from kvfleet_operator.status import (
    AutoscalingStatus,
    LiveMetrics,
    ScalingReport,
    k8s_time,
    pod_ready,
    unschedulable,
)

log = logging.getLogger("kvfleet.autoscaler")


@dataclass(frozen=True)
class AutoscalerConfig:
    prometheus_url: str | None = None
    """Read signals from this Prometheus; None: scrape the pods' /metrics directly."""
    interval_s: float = 15.0
    """Seconds between two decisions for every autoscaled service."""
    stale_s: float = 60.0
    """A pod sample older than this is missing data (the policy then holds)."""
    prometheus_timeout_s: float = 5.0
    """Longest a Prometheus query may take (asked of Prometheus, and the HTTP read's bound):
    a hung Prometheus costs one tick, not all autoscaling."""
    prometheus_verify_tls: bool = True
    """Verify an https Prometheus's certificate (off only with an explicit flag)."""
    prometheus_rate_window: str = "1m"
    """The rate() window of the arrival rate and of the SLO's TTFT quantile (a Prometheus
    duration, at least four scrape intervals): a longer one lags a burst's end by that much,
    and the forecast's scale-down hold with it."""


def config_of(
    a: Autoscaling, max_running_requests: int | None = None, interval_s: float = 15.0
) -> ScalingConfig:
    return ScalingConfig(
        max_running_requests=max_running_requests,
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        warm_replicas=a.warm_replicas,
        target_queue_depth=a.target_queue_depth,
        target_kv_cache_usage=a.target_kv_cache_usage,
        scale_up_window_s=float(a.scale_up_stabilization_seconds),
        scale_down_window_s=float(a.scale_down_stabilization_seconds),
        cold_start_s=float(a.cold_start_seconds),
        warm_auto=a.warm_pool == "auto",
        slo_ttft_s=a.slo.ttft_seconds if a.slo else None,
        slo_itl_s=a.slo.itl_seconds if a.slo else None,
        interval_s=interval_s,
    )


@dataclass(frozen=True)
class Scaled:
    """The latest decision for one service, as the reconcile applies and reports it."""

    decision: Decision
    at: float
    source: str
    cold_start_s: float
    ttft_p99: float | None = None
    queue_depth: float | None = None
    cost_per_1k_tokens: float | None = None
    arrival_rate: float | None = None
    in_flight: Mapping[str, float] = field(default_factory=dict)
    """Requests running or queued on each ready engine pod in the latest observation (a pod
    the reader had no sample of is absent): which to demote first."""

    @property
    def idle(self) -> frozenset[str]:
        """Engine pods with nothing running or queued in the latest observation."""
        return frozenset(name for name, n in self.in_flight.items() if n == 0)


@dataclass
class Autoscaler:
    kube: Kube
    config: AutoscalerConfig
    clock: Callable[[], float] = time.time
    states: dict[Key, State] = field(default_factory=dict)
    latest: dict[Key, Scaled] = field(default_factory=dict)
    on_decision: Callable[[Key, Scaled | None, Scaled], None] | None = None
    """Told each decision with the one before it (None: the first): the operator's metrics."""
    prefill_states: dict[Key, State] = field(default_factory=dict)
    prefill_latest: dict[Key, Scaled] = field(default_factory=dict)
    """A disaggregated service's prefill pool, scaled on its own (prefill.autoscaling)."""
    _seen_ready: dict[Key, set[str]] = field(default_factory=dict)
    _prefill_seen: dict[Key, set[str]] = field(default_factory=dict)
    _last_gateway: dict[Key, _GatewayCounters] = field(default_factory=dict)
    """Direct scrape: the gateways' counters at the previous tick."""

    def __post_init__(self) -> None:
        self.reader: PrometheusReader | DirectReader = (
            PrometheusReader(
                self.config.prometheus_url,
                self.config.prometheus_timeout_s,
                self.config.prometheus_verify_tls,
                self.config.prometheus_rate_window,
            )
            if self.config.prometheus_url
            else DirectReader()
        )

    def _pods(self, key: Key) -> ServicePods:
        pods = self.kube.list(POD, key[0], f"{ISVC_LABEL}={key[1]}")
        comp = "app.kubernetes.io/component"
        # A multi-node replica counts once: its leader (workers carry worker-index 1..).
        engines = [
            p
            for p in pods
            if (labels := p["metadata"].get("labels") or {}).get(comp) == "engine"
            and not is_group_worker(labels)
        ]
        gateways = [p for p in pods if (p["metadata"].get("labels") or {}).get(comp) == GATEWAY]
        prefills = [p for p in pods if (p["metadata"].get("labels") or {}).get(comp) == PREFILL]
        return ServicePods(key[0], key[1], engines, gateways, prefills=prefills)

    def _books(self, pool: Pool) -> tuple[dict[Key, State], dict[Key, Scaled], dict[Key, set[str]]]:
        """A pool's states, latest decisions and pods seen ready, by service."""
        if pool.name == ENGINE:
            return self.states, self.latest, self._seen_ready
        return self.prefill_states, self.prefill_latest, self._prefill_seen

    def _state(self, key: Key, body: Json, pool: Pool) -> State:
        states = self._books(pool)[0]
        if key not in states:  # a restart: continue from what the status recorded
            status = (
                ((body.get("status") or {}).get("autoscaling") or {}) if pool.name == ENGINE else {}
            )
            states[key] = State(desired_active=status.get("desiredActive"))
        return states[key]

    def _learn(
        self, key: Key, svc: ServicePods, config: ScalingConfig, state: State, pool: Pool
    ) -> State:
        seen = self._books(pool)[2].setdefault(key, set())
        fresh: list[float] = []
        for pod in svc.engines:
            name = pod["metadata"]["name"]
            ready = ready_since(pod)
            if ready is None or name in seen:
                continue
            seen.add(name)
            created = pod["metadata"].get("creationTimestamp")
            if created and state.since is not None:  # pods already up at start are not samples
                fresh.append(max(0.0, ready - parse_time(created)))
        return learn_cold_start(config, state, fresh)

    def _demand(self, key: Key, obs: Observation, now: float, q: float) -> Demand:
        """This service's arrival rate and SLO latencies: Prometheus computes them; a direct
        scrape gives counters, differenced against the previous tick (a counter that went
        down — a gateway restarted — gives nothing this tick)."""
        bound = obs.replica_throughput.get(key)
        if obs.source != "direct":
            return Demand(obs.arrival_rate.get(key), obs.slo_ttft.get(key), obs.slo_itl.get(key),
                          bound)  # fmt: skip
        total = obs.arrivals_total.get(key)
        if total is None:
            return Demand(replica_throughput=bound)
        seen = _GatewayCounters(now, total, obs.ttft_buckets.get(key, {}),
                                obs.itl_buckets.get(key, {}))  # fmt: skip
        last = self._last_gateway.get(key)
        self._last_gateway[key] = seen
        if last is None or now <= last.at or total < last.arrivals:
            return Demand(replica_throughput=bound)
        rate = (total - last.arrivals) / (now - last.at)
        return Demand(rate, _delta_quantile(seen.ttft, last.ttft, q),
                      _delta_quantile(seen.itl, last.itl, q), bound)  # fmt: skip

    async def tick(self, bodies: dict[Key, Json]) -> list[Key]:
        """One decision per autoscaled pool (a service's engines; a disaggregated service's
        prefill pool too); returns the services whose decision or reported numbers changed
        (the caller reconciles them)."""
        plans: list[tuple[Key, Json, list[Pool]]] = []
        for key, body in bodies.items():
            try:
                spec = parse_spec(body.get("spec"))
            except ValueError:
                continue  # an invalid spec is the reconcile's to report
            pools = pools_of(spec, self.config.interval_s)
            if pools:
                plans.append((key, body, pools))
        for name, states, latest in (
            (ENGINE, self.states, self.latest),
            (PREFILL, self.prefill_states, self.prefill_latest),
        ):
            keep = {k for k, _, pools in plans if any(p.name == name for p in pools)}
            for key in set(states) - keep:
                states.pop(key, None)
                latest.pop(key, None)
        if not plans:
            return []
        services = await asyncio.gather(*(asyncio.to_thread(self._pods, k) for k, _, _ in plans))
        services = [
            dataclasses.replace(svc, ttft_quantile=_quantile_of(body))
            for svc, (_, body, _) in zip(services, plans, strict=True)
        ]
        read = [*services, *(s.prefill_pool() for s in services if s.prefills)]
        obs: Observation = await self.reader.read(read)
        now = self.clock()
        changed: list[Key] = []
        for (key, body, pools), svc in zip(plans, services, strict=True):
            demand = self._demand(key, obs, now, svc.ttft_quantile)  # once: it differences
            for pool in pools:
                pool_svc = svc if pool.name == ENGINE else svc.prefill_pool()
                pool_demand = demand
                if pool.name != ENGINE:  # a prefill replica does half of each request
                    pool_demand = dataclasses.replace(demand, replica_throughput=None)
                decided = self._decide(key, body, pool, pool_svc, obs, now, pool_demand)
                if decided and key not in changed:
                    changed.append(key)
        return changed

    def _decide(self, key: Key, body: Json, pool: Pool, svc: ServicePods, obs: Observation,
                now: float, demand: Demand) -> bool:  # fmt: skip
        """Decide one pool; True when the decision or its reported numbers changed."""
        config = pool.config
        state = self._learn(key, svc, config, self._state(key, body, pool), pool)
        # A young replica may hold a scale-down back no longer than the window itself.
        grace = min(config.readiness_grace_s, config.scale_down_window_s)
        sig = signals_for(svc, obs, now, self.config.stale_s, grace, demand)
        ready = [p for p in svc.engines if pod_ready(p)]
        fleet = fleet_of(svc.engines)
        decision, state = decide(config, state, fleet, sig, now)
        in_flight = {
            p["metadata"]["name"]: m.queue + m.running
            for p in ready
            if (m := obs.pods.get((key[0], p["metadata"]["name"]))) is not None
        }
        queue = sum(r.queue for r in sig.replicas) if sig.replicas else None
        new = Scaled(decision, now, obs.source, cold_start(config, state),
                     obs.ttft_p99.get(key), queue, obs.cost_per_1k_tokens.get(key),
                     sig.arrival_rate, in_flight)  # fmt: skip
        states, latest, _ = self._books(pool)
        states[key] = state
        old = latest.get(key)
        latest[key] = new
        if self.on_decision is not None and pool.name == ENGINE:
            self.on_decision(key, old, new)
        if decision.changed:
            log.info("%s/%s%s: %s", *key, "" if pool.name == ENGINE else " (prefill)",
                     decision.reason)  # fmt: skip
        return old is None or _reported(old) != _reported(new) or decision.changed


def fleet_of(engines: list[Json]) -> Fleet:
    """The policy's count of a pool's pods. A pod no node fits (the scheduler's
    `Unschedulable`) is not capacity on the way: counted as starting it would hold the queue's
    scale-up back for a cold start and silence the objective's, for a replica never coming."""
    ready = [p for p in engines if pod_ready(p)]
    return Fleet(
        active=sum(1 for p in ready if role_of(p) == "active"),
        warm=sum(1 for p in ready if role_of(p) == "warm"),
        starting=sum(
            1
            for p in engines
            if not pod_ready(p)
            and not p["metadata"].get("deletionTimestamp")
            and unschedulable(p) is None
        ),
    )


@dataclass(frozen=True)
class _GatewayCounters:
    at: float
    arrivals: float
    ttft: dict[float, float]
    itl: dict[float, float]


def _delta_quantile(now: dict[float, float], before: dict[float, float], q: float) -> float | None:
    """`q` of the observations between two scrapes of a cumulative histogram."""
    delta = {le: n - before.get(le, 0.0) for le, n in now.items()}
    return quantile(delta, q) if all(v >= 0 for v in delta.values()) else None


@dataclass(frozen=True)
class Pool:
    """One autoscaled pool of a service: its engines (ENGINE) or its prefill pool (PREFILL)."""

    name: str
    config: ScalingConfig


def pools_of(spec: InferenceServiceSpec, interval_s: float) -> list[Pool]:
    """The autoscaled pools of a service."""
    max_running = spec.engine.max_running_requests
    pools = []
    if spec.autoscaling is not None:
        pools.append(Pool(ENGINE, config_of(spec.autoscaling, max_running, interval_s)))
    d = spec.disaggregation
    if d is not None and d.prefill.autoscaling is not None:
        prefill = config_of(d.prefill.autoscaling, max_running, interval_s)
        # Tokens after the first come from the decode pool: a slow stream is not the prefill
        # pool's to fix (its spec refuses itlSeconds; this keeps the policy's view the same).
        pools.append(Pool(PREFILL, dataclasses.replace(prefill, slo_itl_s=None)))
    return pools


def _quantile_of(body: Json) -> float:
    slo = (((body.get("spec") or {}).get("autoscaling") or {}).get("slo")) or {}
    value = slo.get("attainment", 0.99)
    return float(value) if isinstance(value, int | float) else 0.99


def _reported(s: Scaled) -> tuple[object, ...]:
    d = s.decision
    return (
        d.desired_active,
        d.desired_warm,
        d.holding,
        d.reason.split(":")[0],
        round(s.queue_depth or 0.0, 1),
        round(d.kv_cache_usage or 0.0, 2),
        round(s.ttft_p99 or 0.0, 2),
        round(s.cost_per_1k_tokens or 0.0, 4),
        s.idle,
    )


def report(scaled: Scaled, previous: Json | None) -> ScalingReport:
    """The status the reconcile writes for a decision; times move only on change."""
    d, prev = scaled.decision, previous or {}
    numbers = AutoscalingStatus(
        desired_active=d.desired_active,
        desired_warm=d.desired_warm,
        reason=d.reason,
        holding=d.holding,
        source=scaled.source,
        queue_per_replica=_round(d.queue_per_replica, 2),
        kv_cache_usage=_round(d.kv_cache_usage, 3),
        held_requests=round(d.held_requests, 1),
        recommendation=d.recommendation,
        cold_start_seconds=round(scaled.cold_start_s, 1),
        bound_by=d.bound_by,
        forecast_requests_per_second=_round(d.forecast_rate, 2),
        forecast_trend_weight=_round(d.trend_weight, 2),
        capacity_requests_per_second=_round(d.capacity_per_replica, 2),
        replica_throughput_requests_per_second=_round(d.replica_throughput, 2),
        missing_pods=d.missing or None,
    )
    said = to_json(numbers)
    same = all(prev.get(k) == v for k, v in said.items())
    resized = (prev.get("desiredActive"), prev.get("desiredWarm")) != (
        d.desired_active,
        d.desired_warm,
    )
    stamp = k8s_time(scaled.at)
    numbers = dataclasses.replace(
        numbers,
        last_decision_time=prev.get("lastDecisionTime") if same else stamp,
        last_scale_time=stamp if resized else prev.get("lastScaleTime", stamp),
    )
    metrics = LiveMetrics(
        queue_depth=_round(scaled.queue_depth, 1),
        kv_cache_usage=_round(d.kv_cache_usage, 3),
        ttft_p99=_round(scaled.ttft_p99, 3),
        cost_per_1k_tokens=_round(scaled.cost_per_1k_tokens, 6),
        arrival_rate=_round(scaled.arrival_rate, 2),
    )
    live = metrics if to_json(metrics) else None
    if d.holding:
        return ScalingReport(False, "MetricsUnavailable", d.reason, numbers, live)
    limited = d.recommendation is not None and d.recommendation != d.desired_active
    reason = "Stabilizing" if limited else "ScalingActive"
    return ScalingReport(True, reason, d.reason, numbers, live)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)
