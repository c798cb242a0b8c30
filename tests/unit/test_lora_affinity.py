"""Adapter affinity, the pure decision the gateway and the fleet simulator share: holders
first, spilling to a less busy replica; and the simulator's bookkeeping around it."""

from __future__ import annotations

from collections import Counter

from kvfleet_gateway.lora import affinity
from kvfleet_gateway.routing import Candidate, EngineSignals
from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig
from kvfleet_sim.fleet.lora_fleet import FleetAdapters
from kvfleet_sim.fleet.model import FleetConfig
from kvfleet_sim.fleet.routing import routed_fleet
from kvfleet_sim.fleet.traces import RateTrace
from kvfleet_sim.fleet.workloads import Workload, WorkloadSpec


def test_holders_first_and_idle_replicas_only_when_every_holder_has_a_queue() -> None:
    held = [True, False, True, False]
    assert affinity(held, [2, 0, 3, 1]) == [0, 1, 2]  # every holder waits: the idle one too
    assert affinity(held, [2, 0, 0, 1]) == [0, 2]  # a holder starts it at once: no load
    assert affinity(held, [2, 4, 3, 1]) == [0, 2]  # saturation: a load would help nobody
    assert affinity(held, [2, None, 3, 0]) == [0, 2, 3]  # unknown: never spilled to
    assert affinity(held, [None, 0, 3, 0]) == [0, 2]  # a holder not scraped: it may be idle
    assert affinity([False, False], [4, None]) == [0, 1]  # none holds it: all


def test_a_queue_scraped_before_a_request_ended_does_not_spill_the_next() -> None:
    """The gateway's holder was scraped while its own request waited there; that request has
    ended since, so the next one for the adapter stays with the holder instead of loading the
    adapter on a second replica (seen in CI: both replicas loaded one adapter)."""
    import time

    from kvfleet_gateway.backends import Backend
    from kvfleet_gateway.config import Lora
    from kvfleet_gateway.lora import AdapterManager

    now = time.monotonic()
    holder, other = Backend("http://a", adapters={"chat": "base"}), Backend("http://b")
    for b, queue in ((holder, 1), (other, 0)):
        b.signals, b.scraped_at = EngineSignals(queue, 0, 0.1, 1000, 0.0, 0.0), now
    manager = AdapterManager(Lora())
    assert manager.offered([holder, other], "chat") == [holder, other]  # it waits: spill
    holder.finished_requests += 1  # the waiting request ended after the scrape
    assert manager.offered([holder, other], "chat") == [holder]
    holder.finished_at_scrape = holder.finished_requests  # a new scrape: still one waiting
    assert manager.offered([holder, other], "chat") == [holder, other]


def test_the_simulator_holds_loads_and_evicts_as_the_gateway_does() -> None:
    fa = FleetAdapters(aware=True, max_per_replica=2, load_s=0.1)
    assert fa.place("r0", "a") == 0.1 and fa.place("r0", "a") == 0.0  # loaded once
    fa.ended("r0", "a")
    fa.ended("r0", "a")
    assert fa.place("r0", "b") == 0.1
    fa.place("r0", "c")  # at the bound: the least recently used idle adapter (a) goes
    assert list(fa.held["r0"]) == ["b", "c"]
    fa.place("r0", "d")  # b and c are in use: nothing idle to unload, d loads anyway
    assert list(fa.held["r0"]) == ["b", "c", "d"] and fa.loads == 4
    signals = [EngineSignals(queue, 8, 0.5, 100_000, 0.0, 0.0) for queue in (3, 0, 1)]
    cands = [Candidate(f"r{i}", 10, 0, s) for i, s in enumerate(signals)]
    assert [c.key for c in fa.offer("b", cands)] == ["r0", "r1"]  # r0 waits, r1 is idle
    unaware = FleetAdapters(aware=False, max_per_replica=2, load_s=0.1)
    assert unaware.offer("b", cands) == cands


def test_adapters_follow_zipf_popularity_without_changing_the_prompts() -> None:
    base = WorkloadSpec("random", 4000, seed=3, input_len=64, output_len=8)
    plain = list(Workload(base, RateTrace("poisson", rate=10.0), 1000))
    spec = WorkloadSpec("random", 4000, seed=3, input_len=64, output_len=8, lora_adapters=100)
    with_lora = list(Workload(spec, RateTrace("poisson", rate=10.0), 1000))
    assert [a.prompt_ids for a in plain] == [a.prompt_ids for a in with_lora]
    counts = Counter(a.adapter for a in with_lora)
    # 1/k over 100 adapters: the first ~19% of requests, the tenth ~1.9%.
    assert 0.16 < counts["adapter-0"] / 4000 < 0.23
    assert 0.01 < counts["adapter-9"] / 4000 < 0.03


def test_affinity_loads_fewer_adapters_than_a_router_that_ignores_them() -> None:
    engine = EngineConfig.for_model(BUILTIN.model("llama-3.1-8b"), BUILTIN.gpu("h100"))
    config = FleetConfig(EngineConfig(**{**engine.__dict__, "max_loras_per_batch": 4}), replicas=4)
    loads = {}
    for policy, aware in (("kvfleet", True), ("round_robin", False)):
        sim = routed_fleet(config, policy)
        sim.adapters = FleetAdapters(aware=aware, max_per_replica=4, load_s=0.07)
        spec = WorkloadSpec("random", 600, seed=1, input_len=256, output_len=32, lora_adapters=20)
        result = sim.run(Workload(spec, RateTrace("poisson", rate=20.0), 128256))
        assert result.summary.requests == 600
        loads[policy] = sim.adapters.loads
    assert loads["kvfleet"] * 3 < loads["round_robin"], loads


def test_eviction_takes_the_least_recently_used_idle_adapter_at_the_bound() -> None:
    from kvfleet_gateway.lora import eviction

    used = {"a": 3.0, "b": 1.0, "c": 2.0}
    assert eviction(["a", "b", "c"], set(), used, bound=4) is None  # room enough
    assert eviction(["a", "b", "c"], set(), used, bound=3) == "b"
    assert eviction(["a", "b", "c"], {"b"}, used, bound=3) == "c"  # b is running
    assert eviction(["a", "b", "c"], {"a", "b", "c"}, used, bound=3) is None
