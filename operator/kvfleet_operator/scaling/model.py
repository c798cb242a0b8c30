"""What the autoscaling policy reads and decides: one service's configuration, a tick's
signals, its fleet, the state carried from tick to tick, and the decision. Data only."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet_kernel.schema import fld
from kvfleet_operator.scaling.forecast import Capacity, Forecast


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """The bounds and targets of one service (from its spec) and the policy's tuning."""

    min_replicas: int = fld(1, "Fewest active replicas.")
    max_replicas: int = fld(10, "Most replicas, active + warm.")
    warm_replicas: int = fld(0, "Loaded spares kept beside the active ones.")
    target_queue_depth: float = fld(
        4.0, "Waiting requests per active replica (with an SLO, a wait over half of it too)."
    )
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
    replica_throughput: float | None = None
    """Requests per second one replica completes at most at the recent request mix, as the
    gateways estimate it from their calibrated speeds (None: unknown)."""


@dataclass(frozen=True)
class Fleet:
    """The service's engine pods as the cluster reports them."""

    active: int
    """Ready pods labelled active."""
    warm: int
    """Ready pods labelled warm."""
    starting: int
    """Pods created and not ready yet, placed on a node or being placed (one the scheduler
    finds no node for is not capacity on the way)."""


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
    falling_since: tuple[float, float] | None = None
    """(since when, the level then) the forecast's trend has been negative (None: it is not)."""
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
    trend_weight: float | None = None
    """The share of the trend the forecast extrapolated (None: no forecast yet)."""
    capacity_per_replica: float | None = None
    """Requests per second one replica serves at the KV target (learned)."""
    replica_throughput: float | None = None
    """The gateways' roofline of one replica at the recent mix (None: not reported)."""
    missing: tuple[str, ...] = ()
    """Active replicas without fresh metrics (counted saturated; no scale-down)."""

    @property
    def desired_total(self) -> int:
        return self.desired_active + self.desired_warm
