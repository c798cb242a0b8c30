"""spec.gateway.fairSharing rendered into the gateway's config: the slots of the engines
split between gateway replicas, the reserve kept below them, the scraped queue otherwise."""

from __future__ import annotations

from typing import Any

from kvfleet_operator.render import owner_of
from kvfleet_operator.render.gateway import gateway_config
from tests.support.objects import isvc


def _fairness(engine: dict[str, Any], **gateway: Any) -> Any:
    doc = isvc("llama", engine={"gpuType": "h100", **engine},
               gateway={"insecureNoAuth": True, "fairSharing": {}, **gateway})  # fmt: skip
    doc["metadata"]["uid"] = "5f0c2b9e-0000-4000-8000-000000000009"
    return gateway_config(owner_of(doc)).fairness


def test_fair_sharing_saturates_at_the_engines_slots_split_between_gateways() -> None:
    one = _fairness({"maxRunningRequests": 32})
    assert one.enabled and (one.max_inflight_per_replica, one.reserve_per_replica) == (32, 1)
    three = _fairness({"maxRunningRequests": 32}, replicas=3, limitsStore="redis://r:6379/0")
    assert three.max_inflight_per_replica == 11  # ceil(32 / 3): each gateway counts its own
    tight = _fairness({"maxRunningRequests": 2}, replicas=2, limitsStore="redis://r:6379/0")
    assert (tight.max_inflight_per_replica, tight.reserve_per_replica) == (1, 0)
    signals = _fairness({})
    assert signals.max_inflight_per_replica is None and signals.queue_per_replica == 1
    assert not _fairness({}, fairSharing=None).enabled
