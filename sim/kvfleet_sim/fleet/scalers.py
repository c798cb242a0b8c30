"""Scalers for the fleet simulator: the operator's own policy, and the baselines it is
measured against.

- `kvfleet`: `kvfleet_operator.scaling.policy.decide` — the function the operator runs —
  fed what the operator would read (the engines' queue, running and KV gauges; the
  gateway's held requests) and applied with warm-pool semantics (new replicas start warm,
  spares are promoted in `promotion_s`).
- `hpa_util`: a HorizontalPodAutoscaler on GPU utilization (the engine's busy share, as
  DCGM reports it) with HPA's defaults: target 80%, tolerance 10%, no scale-up
  stabilization, 300 s scale-down stabilization, +max(4, 100%) per tick.
- `keda_load`: KEDA on the engines' waiting + running requests per replica (as llm-d
  recommends configuring it on its router's metrics), its HPA with a 300 s scale-down
  stabilization; the threshold is the user's to tune (the bench sweeps it).
- Either baseline with a static warm floor: `minReplicas` raised, as a platform team keeps
  headroom without a warm pool.
- `static`: a fixed size from start to end (sized by the bench for the trace's peak): what
  a team without an autoscaler runs, and what a policy that cannot see a step coming
  must pay before it to meet it.
- `oracle`: knows every arrival; plans each window's size from the true rate over the
  window a cold start ahead, at a per-replica capacity measured on the workload's own
  token mix, times a headroom the bench raises until the oracle keeps the SLO (an upper
  bound on what foresight buys, not a product policy).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet_operator.scaling.model import (
    Decision,
    Fleet,
    ReplicaSignals,
    ScalingConfig,
    Signals,
    State,
)
from kvfleet_operator.scaling.policy import decide
from kvfleet_sim.fleet.model import FleetView, Target


@dataclass
class KvfleetScaler:
    config: ScalingConfig
    state: State = field(default_factory=State)
    reasons: list[tuple[float, str]] = field(default_factory=list)
    decisions: list[tuple[float, Decision]] = field(default_factory=list)
    _last: tuple[float, int] = (0.0, 0)
    """(time, arrivals counter) at the previous tick: the rate is its difference. The counter
    starts with the fleet (as a gateway's counter, which Prometheus has scraped before the
    first decision: the first tick has a rate too)."""

    def _rate(self, view: FleetView) -> float | None:
        last, self._last = self._last, (view.now, view.arrived)
        if view.now <= last[0]:
            return None
        return (view.arrived - last[1]) / (view.now - last[0])

    def target(self, view: FleetView) -> Target:
        ttfts = sorted(view.recent_ttfts)
        ttft = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None
        signals = Signals(
            tuple(
                ReplicaSignals(
                    r.name,
                    float(r.load.num_waiting_reqs),
                    float(r.load.num_running_reqs),
                    r.load.token_usage,
                    young=r.index in view.young,
                )
                for r in view.active
            ),
            held=float(view.held),
            arrival_rate=self._rate(view),
            ttft=ttft,
            replica_throughput=view.replica_throughput,
        )
        fleet = Fleet(len(view.active), view.warm, view.starting)
        decision, self.state = decide(self.config, self.state, fleet, signals, view.now)
        self.decisions.append((view.now, decision))
        if decision.changed:
            self.reasons.append((view.now, decision.reason))
        return Target(decision.desired_active, decision.desired_warm)


@dataclass
class HpaScaler:
    """HPA's algorithm (ratio, tolerance, windows, step limits) on one metric per replica."""

    metric: Callable[[FleetView], float]
    """The metric's value per replica, averaged (or summed over replicas / count)."""
    target_value: float
    min_replicas: int = 1
    max_replicas: int = 10
    down_window_s: float = 300.0
    history: list[tuple[float, int]] = field(default_factory=list)
    current: int | None = None

    def target(self, view: FleetView) -> Target:
        current = self.current if self.current is not None else max(1, len(view.active))
        value = self.metric(view)
        if len(view.active) == 0:
            raw = max(1, self.min_replicas) if view.held else self.min_replicas
        else:
            ratio = value / self.target_value
            raw = current if abs(ratio - 1) <= 0.1 else math.ceil(current * ratio)
        raw = max(self.min_replicas, min(self.max_replicas, raw))
        self.history = [(t, r) for t, r in self.history if view.now - t < self.down_window_s]
        self.history.append((view.now, raw))
        if raw > current:
            desired = min(raw, current + max(4, current))
        else:
            desired = max(r for _, r in self.history)
            desired = min(desired, current)
        self.current = max(self.min_replicas, min(self.max_replicas, desired))
        return Target(self.current)


def hpa_util(min_replicas: int, max_replicas: int, target: float = 0.8) -> HpaScaler:
    """HPA on GPU utilization (the share of replicas busy), at `target` (HPA's usual 80%)."""

    def utilization(view: FleetView) -> float:
        return sum(view.busy) / len(view.busy) if view.busy else 0.0

    return HpaScaler(utilization, target, min_replicas, max_replicas)


def keda_queue(min_replicas: int, max_replicas: int, per_replica: float = 4.0) -> HpaScaler:
    def queue(view: FleetView) -> float:
        waiting = sum(r.load.num_waiting_reqs for r in view.active) + view.held
        return waiting / max(1, len(view.active))

    return HpaScaler(queue, per_replica, min_replicas, max_replicas)


def keda_load(min_replicas: int, max_replicas: int, per_replica: float) -> HpaScaler:
    """KEDA on waiting + running requests per replica (the gateway's held ones included)."""

    def load(view: FleetView) -> float:
        busy = sum(r.load.num_waiting_reqs + r.load.num_running_reqs for r in view.active)
        return (busy + view.held) / max(1, len(view.active))

    return HpaScaler(load, per_replica, min_replicas, max_replicas)


@dataclass
class StaticScaler:
    size: int

    def target(self, view: FleetView) -> Target:
        return Target(self.size)


@dataclass
class OracleScaler:
    rate_at: Callable[[float], float]
    capacity: float
    """Requests per second one replica serves within the SLO (measured on the simulator)."""
    lead_s: float
    """How far ahead to provision: cold start plus one tick."""
    min_replicas: int = 1
    max_replicas: int = 10
    window_s: float = 15.0
    """The decision interval: the size ordered now serves [now + lead, now + lead + window]."""
    headroom: float = 1.0
    """Capacity planned per unit of rate (raised by the bench until the SLO holds)."""

    def target(self, view: FleetView) -> Target:
        # What is ordered now is ready a cold start later and must serve until the next
        # order is ready: the peak over that window; what is already there serves until then.
        start, end = view.now, view.now + self.lead_s + self.window_s
        horizon = [self.rate_at(start + dt) for dt in range(0, int(end - start) + 1, 5)]
        need = math.ceil(max(horizon) * self.headroom / self.capacity - 1e-9)
        return Target(max(self.min_replicas, min(self.max_replicas, need)))
