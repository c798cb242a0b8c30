"""The disaggregated fleet in simulated time, and the PD benchmark's goals (which can fail)."""

from __future__ import annotations

from typing import Any

from kvfleet_bench.pd import WORKLOADS, Shape, arrivals, attainment, serve
from kvfleet_bench.pd_report import goals
from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig, derive_layout
from kvfleet_sim.fleet.pd import PdFleet, PdFleetConfig
from kvfleet_sim.fleet.routing import make_policy

ENGINE = EngineConfig.for_model(BUILTIN.model("llama-3.1-8b"), BUILTIN.gpu("h100"), tp_size=1)
PREFILL_HEAVY = next(w for w in WORKLOADS if w.name == "prefill-heavy")


def _fleet(link: str, p: int = 2, d: int = 2) -> PdFleet:
    config = PdFleetConfig(ENGINE, ENGINE, p, d, BUILTIN.link(link))
    return PdFleet(config, make_policy("kvfleet"), make_policy("least_load"))


def test_the_kv_crosses_the_link_before_decoding() -> None:
    reqs = arrivals(PREFILL_HEAVY, 2.0, seed=1)
    fast, slow = _fleet("nvlink").run(reqs), _fleet("eth100").run(reqs)
    assert len(fast.records) == len(slow.records) == len(reqs)
    kv = derive_layout(ENGINE).kv_bytes_per_token_per_gpu
    eth = BUILTIN.link("eth100")
    assert slow.transfer_s[0] == eth.setup_latency_s + 8192 * kv / eth.bandwidth
    # An 8k-token prompt's KV (1 GiB for Llama-3.1-8B) takes ~86 ms over 100G Ethernet.
    assert 0.07 < slow.transfer_s[0] < 0.1
    ttft = sorted(r.ttft for r in slow.records)[len(reqs) // 2]
    assert ttft > sorted(r.ttft for r in fast.records)[len(reqs) // 2]
    assert all(r.output_tokens == 128 for r in slow.records)


def test_decode_engines_compute_no_prompt_and_prefill_engines_no_answer() -> None:
    fleet = _fleet("ib400")
    result = fleet.run(arrivals(PREFILL_HEAVY, 2.0, seed=2))
    n = len(result.records)
    assert sum(node.engine.counters.prompt_tokens for node in fleet.decodes) == 0
    assert sum(node.engine.counters.generation_tokens for node in fleet.prefills) == n
    assert sum(node.engine.counters.generation_tokens for node in fleet.decodes) == 127 * n + n


def test_colocated_and_disaggregated_serve_the_same_requests() -> None:
    reqs = arrivals(PREFILL_HEAVY, 4.0, seed=3)
    colocated, _ = serve(Shape("colocated"), reqs)
    pd, transfers = serve(Shape("pd", 6, 2, "ib400"), reqs)
    assert len(colocated) == len(pd) == len(reqs) and len(transfers) == len(reqs)
    assert 0.0 <= attainment(pd, PREFILL_HEAVY) <= 1.0


def _cells(colocated: float, pd: float) -> list[dict[str, Any]]:
    out = []
    for wl in WORKLOADS:
        out.append({"workload": wl.name, "mode": "colocated", "ratio": None, "link": None,
                    "seed": 1, "goodput": colocated})  # fmt: skip
        for link in ("ib400", "eth100"):
            out.append({"workload": wl.name, "mode": "pd", "ratio": "6:2", "link": link,
                        "seed": 1, "goodput": pd})  # fmt: skip
    return out


def test_the_goals_can_fail() -> None:
    live_win = [{"kvfleet": {"ttft_p99": 0.1}, "sglang-router": {"ttft_p99": 0.2}}]
    live_loss = [{"kvfleet": {"ttft_p99": 0.3}, "sglang-router": {"ttft_p99": 0.2}}]
    assert [g["met"] for g in goals(_cells(10, 20), live_win)] == [True, False, True]
    assert [g["met"] for g in goals(_cells(10, 12), live_loss)] == [False, False, False]
    assert [g["met"] for g in goals(_cells(10, 9), [])] == [False, True]
    # The live goal holds on every seed or not at all: one losing seed of three fails it.
    mixed = [*live_win, *live_win, *live_loss]
    (live,) = [g for g in goals(_cells(10, 20), mixed) if g["goal"].startswith("live")]
    assert not live["met"] and live["detail"].startswith("2 of 3 seeds")
