"""An InferenceService's autoscaling bounds and latency objectives, as part of the one typed
spec `spec.py` assembles (the CRD schema and the operator both come from it; field docs
become the schema's descriptions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from kvfleet_kernel.schema import Rule, fld


@dataclass(frozen=True, kw_only=True)
class Slo:
    """The latency objectives the autoscaler keeps, judged at the gateways (client-side)."""

    RULES: ClassVar = (
        Rule(
            "has(self.ttftSeconds) || has(self.itlSeconds)",
            "an slo sets ttftSeconds, itlSeconds or both",
            ".ttftSeconds",
        ),
    )
    ttft_seconds: float | None = fld(
        None, "Time to first token not to exceed.", minimum=0.01, maximum=3600
    )
    itl_seconds: float | None = fld(
        None,
        "Inter-token latency (time between streamed chunks) not to exceed: over it, one more"
        " replica — the decode pool of a disaggregated service (more replicas, smaller"
        " batches, shorter steps).",
        minimum=0.001,
        maximum=60,
    )
    attainment: float = fld(
        0.99,
        "Share of requests within the objectives: the quantile judged (0.99: the p99).",
        minimum=0.5,
        maximum=0.9999,
    )


@dataclass(frozen=True, kw_only=True)
class Autoscaling:
    """The operator owns the engine replica count; the spec holds only the bounds."""

    RULES: ClassVar = (
        Rule(
            "self.minReplicas <= self.maxReplicas",
            "minReplicas must not exceed maxReplicas",
            ".minReplicas",
        ),
        Rule(
            "self.minReplicas + self.warmReplicas <= self.maxReplicas",
            "minReplicas + warmReplicas must fit within maxReplicas",
            ".warmReplicas",
        ),
    )
    min_replicas: int = fld(1, "Fewest active replicas.", minimum=0)
    max_replicas: int = fld(doc="Most replicas (active + warm).", minimum=1, maximum=1000)
    warm_replicas: int = fld(
        0, "Loaded-but-idle spares kept beside the active ones.", minimum=0, maximum=100
    )
    target_queue_depth: float = fld(
        4.0,
        "Waiting requests per active replica above which to scale up (with slo.ttftSeconds,"
        " once their wait, waiting over arriving, is also over half the objective).",
        minimum=0.1,
    )
    target_kv_cache_usage: float = fld(
        0.85, "KV-cache usage (0..1) above which to scale up.", minimum=0.05, maximum=1.0
    )
    scale_up_stabilization_seconds: int = fld(15, "Window of scale-up decisions.", minimum=0)
    scale_down_stabilization_seconds: int = fld(300, "Window of scale-down.", minimum=0)
    cold_start_seconds: int = fld(
        300, "Expected time from a new pod to a ready replica (planning horizon).", minimum=1
    )
    warm_pool: Literal["fixed", "auto"] = fld(
        "fixed",
        "fixed: warmReplicas spares. auto: at least warmReplicas, and as many more as cover the"
        " growth the demand forecast cannot rule out within a cold start (a high quantile of its"
        " recent under-forecasts, in replicas of the capacity learned so far) that the active"
        " replicas' capacity past the forecast does not already cover; while demand falls"
        " clearly and the fleet has shed an active replica to the fall, only those.",
    )
    slo: Slo | None = fld(
        None,
        "Latency objectives: a TTFT or inter-token latency over its objective adds a replica,"
        " and a tick over one does not count as a rate the fleet served well when the"
        " capacity per replica is learned.",
    )
