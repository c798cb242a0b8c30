"""How the fleet simulator routes: the gateway's own policy objects, fed what a gateway sees.

This module is the simulator's one door to the gateway's routing code (import-linter holds
everything else in kvfleet_sim to that); benchmarks take the names they need from here.

Each replica is offered to the policy as a `Candidate`: the router's exact in-flight counts
plus the engine metrics of the last scrape (as stale as the scrape interval), exactly the
signals the gateway has in production. `ReplicaView` is what a Scaler sees.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfleet_gateway.routing import (
    POLICIES,
    Candidate,
    EngineSignals,
    EventIndex,
    KvfleetTuning,
    Policy,
    RouteRequest,
    make_policy,
)
from kvfleet_gateway.routing.blocks import token_blocks
from kvfleet_gateway.routing.kvfleet import KvfleetPolicy
from kvfleet_gateway.routing.priors import GpuPeak, Priors, roofline_priors
from kvfleet_gateway.routing.random_choice import RandomChoice
from kvfleet_sim.config import EngineConfig
from kvfleet_sim.engine import EngineLoad

if TYPE_CHECKING:
    from kvfleet_sim.fleet.des import FleetSimulator
    from kvfleet_sim.fleet.model import FleetConfig

KVFLEET_EVENTS = "kvfleet_events"
"""`kvfleet` routing on the engines' KV events (gateway prefixIndex: events) instead of its
approximate index: simulator-only name, the same policy object with an `EventIndex`."""
FLEET_POLICIES: tuple[str, ...] = (*POLICIES, KVFLEET_EVENTS, "oracle")


@dataclass(frozen=True, slots=True)
class ReplicaView:
    index: int
    name: str
    load: EngineLoad
    """Last scraped engine metrics (as old as the scrape interval)."""
    scraped_at: float
    inflight_requests: int
    inflight_tokens: int


def signals_of(load: EngineLoad, age_s: float) -> EngineSignals:
    """The engine's /metrics, as the gateway's scraper would have parsed them."""
    return EngineSignals(
        queue_reqs=load.num_waiting_reqs,
        running_reqs=load.num_running_reqs,
        token_usage=load.token_usage,
        max_total_tokens=load.max_total_num_tokens,
        cache_hit_rate=load.cache_hit_rate,
        age_s=age_s,
    )


def deployment_priors(engine: EngineConfig, tuning: KvfleetTuning | None = None) -> Priors:
    """The priors a gateway in front of these engines starts from: the product's roofline
    over what the deployment knows (the model's config.json, its --quantization, the GPU's
    datasheet peaks, the TP size), never the simulator's cost model."""
    t = tuning or KvfleetTuning()
    model = dataclasses.replace(engine.model, checkpoint_quantization=engine.quantization)
    gpu = GpuPeak(engine.gpu.bf16_flops, engine.gpu.fp8_flops, engine.gpu.hbm_bandwidth)
    basis = f"{engine.model.name} on {engine.gpu.name} × {engine.tp_size}"
    return roofline_priors(model, gpu, engine.tp_size, t.peak_efficiency, basis)


def fleet_policy(
    name: str, sim: FleetSimulator | None = None, tuning: KvfleetTuning | None = None
) -> Policy:
    """A gateway policy by name, or `oracle` (which needs the simulator it will read)."""
    if name == "oracle":
        if sim is None:
            raise ValueError("the oracle policy reads a simulator's engines: pass `sim`")
        from kvfleet_sim.fleet.oracle import OraclePolicy

        return OraclePolicy(sim.engines)
    if name == KVFLEET_EVENTS:
        if sim is None:
            raise ValueError("kvfleet_events reads the simulated engines' KV events: pass `sim`")
        index = EventIndex()
        sim.publish_kv_events(index)
        return make_policy(
            KvfleetPolicy.name, tuning, index, deployment_priors(sim.config.engine, tuning)
        )
    if name == RandomChoice.name:  # seeded: a benchmark run is reproducible
        return RandomChoice(seed=1)
    priors = None if sim is None else deployment_priors(sim.config.engine, tuning)
    return make_policy(name, tuning, None, priors)


def routed_fleet(
    config: FleetConfig, policy: str, tuning: KvfleetTuning | None = None, gateways: int = 1
) -> FleetSimulator:
    """A fleet simulator routed by `policy` through `gateways` gateway replicas, each with
    its own policy object (policies such as `oracle` and `kvfleet_events` read the simulator
    itself, so it is built first)."""
    from kvfleet_sim.fleet.des import FleetSimulator

    sim = FleetSimulator(config, make_policy("round_robin"))  # replaced below
    if gateways == 1:
        sim.policy = fleet_policy(policy, sim, tuning)
    else:
        sim.behind_gateways([fleet_policy(policy, sim, tuning) for _ in range(gateways)])
    return sim


__all__ = [
    "FLEET_POLICIES",
    "Candidate",
    "EngineSignals",
    "EventIndex",
    "KvfleetPolicy",
    "KvfleetTuning",
    "Policy",
    "Priors",
    "ReplicaView",
    "RouteRequest",
    "deployment_priors",
    "fleet_policy",
    "make_policy",
    "routed_fleet",
    "signals_of",
    "token_blocks",
]
