"""The fairness benchmark's pieces: the fleet simulator behind the gateway's fair queue puts a
steady tenant ahead of a flood's backlog, and the goals can fail."""

from __future__ import annotations

import json
from typing import Any

from kvfleet_bench.fairness import (
    _merge,
    dump_json,
    fair_gate,
    rate_limited,
    serve,
    tenant_arrivals,
)
from kvfleet_bench.fairness_report import _sweep_table, _why_ttft, goals, limits_table


def _p99(xs: list[float]) -> float:
    return sorted(xs)[int(0.99 * len(xs))]


def test_the_fair_queue_keeps_a_steady_tenant_out_of_a_floods_backlog() -> None:
    flood = [a for a in tenant_arrivals("flood", 150.0, seed=1, salt=0) if a.time < 6.0]
    steady = [a for a in tenant_arrivals("steady", 5.0, seed=1, salt=1) if a.time < 6.0]
    everyone = _merge(flood, steady)
    gate = fair_gate()
    fair, fifo = serve(everyone, gate), serve(everyone, None)
    late = [r.ttft for r in fifo if r.tenant == "steady" and r.arrival > 3.0]
    kept = [r.ttft for r in fair if r.tenant == "steady" and r.arrival > 3.0]
    assert _p99(late) > 10 * _p99(kept), (_p99(late), _p99(kept))
    assert not [s for s in gate.shed if s.arrival.tenant == "steady"]
    assert gate.running == 0 and not len(gate.queue)  # every slot given back


def _run(seed: int, alone: float, fair: float, flood: float, fifo: float) -> dict[str, Any]:
    cell = {"ttft_p99": 0.03, "output_throughput": 1000.0, "seed": seed}
    cells = [
        {**cell, "mode": "alone", "tenant": t, "ttft_p99": alone} for t in ("steady-a", "steady-b")
    ]
    cells += [
        {**cell, "mode": "fair", "tenant": t, "ttft_p99": fair} for t in ("steady-a", "steady-b")
    ]
    cells += [{**cell, "mode": "fair", "tenant": "flood", "output_throughput": flood}]
    cells += [{**cell, "mode": "fifo", "tenant": "flood", "output_throughput": fifo}]
    return {"seed": seed, "cells": cells}


def test_the_goals_can_fail() -> None:
    good = _run(1, alone=0.030, fair=0.033, flood=5000.0, fifo=7000.0)
    assert [g["met"] for g in goals([good])] == [True, True, True]
    assert [g["met"] for g in goals([good, _run(2, 0.030, 0.050, 5000.0, 7000.0)])] == [
        False, True, True,
    ]  # fmt: skip
    # The flood's 3,000 of the 3,000 the steady tenants leave: met; 2,000 of them: missed.
    assert goals([_run(3, 0.030, 0.033, 3000.0, 5000.0)])[1]["met"]
    assert not goals([_run(4, 0.030, 0.033, 2000.0, 5000.0)])[1]["met"]
    assert not goals([_run(5, 0.030, 0.033, 5000.0, 8000.0)])[2]["met"]  # 7,000 vs FIFO 8,000


def _swept(seed: int) -> dict[str, Any]:
    run = _run(seed, alone=0.030, fair=0.050, flood=5000.0, fifo=8000.0)
    for c in run["cells"]:
        c.update(ttft_p50=0.02, waited=0.02 if c["mode"] == "fair" else 0.0, wait_p99=0.004)
    run["sweep"] = [
        {"reserve": 0, "steady_ttft_p50": 0.03, "steady_ttft_p99": 0.1, "steady_waited": 1.0,
         "output_throughput": 8000.0},
        {"reserve": 2, "steady_ttft_p50": 0.02, "steady_ttft_p99": 0.042, "steady_waited": 0.0,
         "output_throughput": 7600.0},
        {"reserve": 4, "steady_ttft_p50": 0.02, "steady_ttft_p99": 0.036, "steady_waited": 0.0,
         "output_throughput": 7200.0},
    ]  # fmt: skip
    run["limits"] = []
    return run


def test_the_report_says_what_a_larger_reserve_buys_and_costs() -> None:
    """The sweep names the smallest reserve at which no steady request waits, with its TTFT
    p99 over alone's (30 ms) and the output it gives up against FIFO's (8,000 tokens/s)."""
    runs = [_swept(1)]
    table = "\n".join(_sweep_table(runs))
    assert "| 1 | 2 | 20 ms | 42 ms | 1.40× | 0.0% | 7,600 | -5.0% |" in table, table
    why = _why_ttft(runs)
    assert "With a reserve of 2 per replica none of them waits" in why, why
    assert "TTFT p99 1.40–1.40× their runs alone at 5.0%–5.0% of FIFO's output" in why, why
    assert "with 4, TTFT p99 1.20–1.20× their runs alone at 10.0%–10.0%" in why, why


def test_the_json_line_keeps_its_contract() -> None:
    """`kvfleet bench fairness --json`'s last line: every cell with exactly the documented
    keys (the sweep rides beside them, each point with its seed)."""
    out = json.loads(dump_json([_swept(1), _swept(2)]))
    keys = {"tenant", "mode", "ttft_p99", "output_throughput", "seed"}
    assert all(set(c) == keys for c in out["cells"]), out["cells"][0]
    assert {c["mode"] for c in out["cells"]} == {"alone", "fair", "fifo"}
    assert {c["seed"] for c in out["cells"]} == {1, 2}
    assert [(p["seed"], p["reserve"]) for p in out["reserve_sweep"]][:3] == [(1, 0), (1, 2), (1, 4)]


def test_a_rate_limit_refuses_past_its_bucket() -> None:
    """10 req/s for 10 s through a 5 req/s bucket holding a second of it: about half pass."""
    arrivals = [a for a in tenant_arrivals("flood", 10.0, seed=1, salt=0) if a.time < 10.0]
    kept, refused = rate_limited(arrivals, 5.0)
    assert len(kept) + refused == len(arrivals)
    assert 45 <= len(kept) <= 56, (len(kept), len(arrivals))
    assert rate_limited(arrivals, 100.0) == (arrivals, 0)


def _limits(factor: float, p99: float, output: float) -> dict[str, Any]:
    return {"factor": factor, "steady_ttft_p99": p99, "output_throughput": output,
            "refused": {"steady-a": 0, "steady-b": 0, "flood": 100}}  # fmt: skip


def test_rate_limits_report_their_best_and_their_cheapest_meeting_the_goal() -> None:
    """Alone 30 ms, FIFO 8,000 tok/s: the best tail is at 0.5× (1.00× alone, 50% lost); the
    cheapest within 1.2× alone is 1× (1.10×, 25% lost), not 2× (2.00×, 0% lost)."""
    run = _swept(1)
    run["limits"] = [_limits(0.5, 0.030, 4000.0), _limits(1.0, 0.033, 6000.0),
                     _limits(2.0, 0.060, 8000.0)]  # fmt: skip
    text = "\n".join(limits_table([run]))
    assert "**best** at 0.5× the share, steady TTFT p99 1.00× alone at 50.0%" in text, text
    assert "cheapest meeting the TTFT goal (1.2× alone) on every seed: 1× the share, 1.10×" in text
    assert "| 1 | 2 | 60 ms | 2.00× | 100 | 0 | 8,000 | +0.0% |" in text, text
    run["limits"] = [_limits(2.0, 0.060, 8000.0)]
    assert "no limit meets the TTFT goal" in "\n".join(limits_table([run]))
