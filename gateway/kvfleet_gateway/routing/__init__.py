"""Routing policies: pick one replica for a request. One protocol (`base.Policy`), one module
per policy, chosen by name from the gateway config (`routing.policy`)."""

from __future__ import annotations

from collections.abc import Callable

from kvfleet_gateway.routing.base import Candidate, EngineSignals, Policy, RouteRequest
from kvfleet_gateway.routing.event_index import EventIndex
from kvfleet_gateway.routing.kvfleet import KvfleetPolicy, KvfleetTuning
from kvfleet_gateway.routing.least_load import LeastLoad
from kvfleet_gateway.routing.priors import Priors, priors_for
from kvfleet_gateway.routing.random_choice import RandomChoice
from kvfleet_gateway.routing.round_robin import RoundRobin
from kvfleet_gateway.routing.sglang_cache_aware import SglangCacheAware

POLICIES: dict[str, Callable[[KvfleetTuning, EventIndex | None, Priors | None], Policy]] = {
    KvfleetPolicy.name: KvfleetPolicy,
    RoundRobin.name: lambda _t, _e, _p: RoundRobin(),
    LeastLoad.name: lambda _t, _e, _p: LeastLoad(),
    SglangCacheAware.name: lambda _t, _e, _p: SglangCacheAware(),
    RandomChoice.name: lambda _t, _e, _p: RandomChoice(),
}
"""The one list of routing policies: the gateway config's and the CRD's enum come from it.
Only `kvfleet` reads the KV-event index; the others route as they would without it
(`sglang_cache_aware` is sglang-router's approximate tree, by design)."""
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
DEFAULT_POLICY = KvfleetPolicy.name


def make_policy(
    name: str,
    tuning: KvfleetTuning | None = None,
    events: EventIndex | None = None,
    priors: Priors | None = None,
) -> Policy:
    """`priors`: where the kvfleet policy's model of a replica starts (None: from `tuning`)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}") from None
    return factory(tuning or KvfleetTuning(), events, priors)


__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "POLICY_NAMES",
    "Candidate",
    "EngineSignals",
    "EventIndex",
    "KvfleetTuning",
    "Policy",
    "Priors",
    "RouteRequest",
    "make_policy",
    "priors_for",
]
