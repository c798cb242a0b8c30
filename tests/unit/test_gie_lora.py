"""The Gateway API Inference Extension's LoRA routing, as the LoRA bench's adapter-aware
baseline: its published decision tree on scraped signals, and a run of the LoRA cell with it."""

from __future__ import annotations

import random

from kvfleet_bench.gie_lora import GieLoraFilter
from kvfleet_bench.routing_lora import lora_cells, saturation_ratios
from kvfleet_gateway.routing import Candidate, KvfleetTuning
from kvfleet_gateway.routing.base import EngineSignals
from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig
from kvfleet_sim.fleet.model import FleetConfig


def _replica(key: str, queue: int, kv: float = 0.1) -> Candidate:
    signals = EngineSignals(queue_reqs=queue, running_reqs=4, token_usage=kv,
                            max_total_tokens=100_000, cache_hit_rate=0.0, age_s=0.5)  # fmt: skip
    return Candidate(key, queue + 4, 1000, signals)


def _keys(found: list[Candidate]) -> list[str]:
    return sorted(c.key for c in found)


def test_the_tree_prefers_replicas_serving_the_adapter_then_short_queues() -> None:
    in_use = {"a": {"sql"}, "b": {"x", "y"}, "c": set(), "d": {"sql"}}
    gie = GieLoraFilter(lambda k: in_use[k], max_active=2, rng=random.Random(1))
    replicas = [_replica("a", 3), _replica("b", 0), _replica("c", 0), _replica("d", 9)]
    # Affinity keeps a and d (serving sql); least queue keeps those within half the spread
    # (3 to 9: up to 6): a.
    assert _keys(gie("sql", replicas)) == ["a"]
    # No replica serves "new": those with room (a, c, d; b is full at 2 adapters), then
    # queues within a third of 0 to 9: a and c.
    assert _keys(gie("new", replicas)) == ["a", "c"]
    # With a threshold of 0 the replicas with room win over those serving it.
    room_first = GieLoraFilter(lambda k: in_use[k], max_active=2, affinity_threshold=0.0)
    assert _keys(room_first("sql", replicas)) == ["c"]


def test_past_the_queue_threshold_the_shortest_queue_comes_first() -> None:
    in_use = {"a": {"sql"}, "b": set()}
    gie = GieLoraFilter(lambda k: in_use[k], max_active=8, queue_threshold=5)
    # Both over 5 waiting: least queue first (b), then affinity among what is left.
    assert _keys(gie("sql", [_replica("a", 40), _replica("b", 6)])) == ["b"]
    assert _keys(gie("sql", [_replica("a", 4), _replica("b", 0)])) == ["a"]


def test_the_lora_cell_runs_the_gie_beside_the_others() -> None:
    engine = EngineConfig.for_model(BUILTIN.model("llama-3.1-8b"), BUILTIN.gpu("h100"))
    runs, capacity = lora_cells(FleetConfig(engine, replicas=2), 120, [1], KvfleetTuning(),
                                lambda _: None)  # fmt: skip
    assert capacity > 0
    assert {r.policy for r in runs} >= {"kvfleet", "gie_lora", "random"}
    ratios = saturation_ratios(runs)
    assert set(ratios) == {"round_robin", "random", "least_load", "gie_lora"}
    assert all(r > 0 for r in ratios.values())
