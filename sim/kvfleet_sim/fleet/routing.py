"""How the fleet simulator routes: the gateway's own policy objects, fed what a gateway sees.

Each replica is offered to the policy as a `Candidate`: the router's exact in-flight counts
plus the engine metrics of the last scrape (as stale as the scrape interval), exactly the
signals the gateway has in production. `ReplicaView` is what a Scaler sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfleet_gateway.routing import POLICIES, EngineSignals, KvfleetTuning, Policy, make_policy
from kvfleet_sim.engine import EngineLoad

if TYPE_CHECKING:
    from kvfleet_sim.fleet.des import FleetSimulator

FLEET_POLICIES: tuple[str, ...] = (*POLICIES, "oracle")


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


def fleet_policy(
    name: str, sim: FleetSimulator | None = None, tuning: KvfleetTuning | None = None
) -> Policy:
    """A gateway policy by name, or `oracle` (which needs the simulator it will read)."""
    if name == "oracle":
        if sim is None:
            raise ValueError("the oracle policy reads a simulator's engines: pass `sim`")
        from kvfleet_sim.fleet.oracle import OraclePolicy

        return OraclePolicy(sim.engines)
    return make_policy(name, tuning)
