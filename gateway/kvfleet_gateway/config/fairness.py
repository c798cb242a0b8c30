"""The gateway's `fairness:` settings (overload: fair queueing, priorities and shedding)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvfleet_gateway.fairness import Saturation, ServiceWeights
from kvfleet_kernel.schema import Duration, Rule, fld


@dataclass(frozen=True, kw_only=True)
class Fairness:
    """When every replica of a model is saturated, requests wait at the gateway (per model,
    bounded, with a deadline) and go out by fair share of the service each tenant received
    (VTC: weighted prompt and output tokens over the tenant's `fairShareWeight`), critical
    before standard before sheddable; a sheddable request is refused instead of queued. Off:
    every request goes to the engines at once (they queue it, first come first served)."""

    RULES: ClassVar = (
        Rule(
            "!self.enabled || has(self.maxInflightPerReplica) || has(self.queuePerReplica)"
            " || has(self.kvCacheUsage)",
            "fairness needs a saturation bound: maxInflightPerReplica, queuePerReplica or"
            " kvCacheUsage",
            ".enabled",
        ),
        Rule(
            "!has(self.maxInflightPerReplica)"
            " || self.reservePerReplica < self.maxInflightPerReplica",
            "reservePerReplica must leave slots for everyone: less than maxInflightPerReplica",
            ".reservePerReplica",
        ),
    )
    enabled: bool = fld(False, "Queue and share fairly under overload.")
    max_inflight_per_replica: int | None = fld(
        None,
        "Requests this gateway keeps in flight on one replica: the engine's batch slots"
        " (--max-running-requests) over the gateway replicas. The exact bound (counted here).",
        minimum=1,
    )
    reserve_per_replica: int = fld(
        1,
        "Of maxInflightPerReplica, slots kept for a tenant under its fair share: it starts at"
        " once instead of waiting for a flood's request to end (costs that many slots of"
        " batch when no such tenant comes).",
        minimum=0,
    )
    queue_per_replica: float | None = fld(
        None,
        "A replica whose engine reports this many waiting requests is saturated (scraped:"
        " up to a scrape interval late).",
        minimum=0,
    )
    kv_cache_usage: float | None = fld(
        None, "A replica whose KV cache is this full (0..1) is saturated.", minimum=0.05,
        maximum=1.0,
    )  # fmt: skip
    max_waiting: int = fld(
        1000, "Requests waiting per model; more are refused (503, Retry-After).", minimum=1
    )
    timeout: Duration = fld(
        Duration(60),
        "Longest wait in the queue; then 503 overloaded with Retry-After, nothing billed.",
    )
    prompt_weight: float = fld(1.0, "Service counted per prompt token.", minimum=0)
    output_weight: float = fld(
        2.0, "Service counted per output token (a decode step costs more).", minimum=0
    )

    def saturation(self) -> Saturation:
        return Saturation(self.max_inflight_per_replica, self.queue_per_replica,
                          self.kv_cache_usage, self.reserve_per_replica)  # fmt: skip

    def service_weights(self) -> ServiceWeights:
        return ServiceWeights(self.prompt_weight, self.output_weight)
