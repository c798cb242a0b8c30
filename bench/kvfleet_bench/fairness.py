"""`kvfleet bench fairness`: a noisy neighbour floods a saturated fleet while two tenants send
steady traffic; first come first served (the engines queue everything) against the
gateway's fair queue (the product's VTC order and slot reserve, in the fleet simulator),
and each steady tenant alone on the same fleet.

The fleet: 4 replicas of Llama-3.1-8B on H100, 32 batch slots each (`--max-running-requests
32`; the gateway keeps as many in flight per replica). Its capacity is measured first, in
the same run: requests per second finished under a saturating load. The steady tenants send
15% of it each; the flood sends 5× its fair share (a third of capacity), so the fleet is
offered about twice what it serves. Every tenant's requests: random prompts of 256–768
tokens, 128-token answers, Poisson arrivals for `WINDOW_S` seconds, measured after
`WARMUP_S`.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from kvfleet_bench.common import Replay
from kvfleet_gateway.fairness import Saturation
from kvfleet_gateway.routing import KvfleetTuning
from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig
from kvfleet_sim.fleet.collector import RequestRecord, percentile
from kvfleet_sim.fleet.fair_gate import FleetGate
from kvfleet_sim.fleet.model import FleetConfig
from kvfleet_sim.fleet.routing import routed_fleet
from kvfleet_sim.fleet.traces import RateTrace
from kvfleet_sim.fleet.workloads import Arrival, Workload, WorkloadSpec

REPLICAS, SLOTS, RESERVE = 4, 32, 1
WINDOW_S = 120.0
"""Seconds of arrivals."""
WARMUP_S = 10.0
"""Measured from here on (every mode alike): the first seconds start from an empty fleet
and zero service counters, which no running gateway has."""
STEADY_SHARE = 0.15
"""Each steady tenant's rate, as a share of the fleet's capacity."""
FLOOD_FACTOR = 5.0
"""The flood's rate over its fair share (a third of capacity)."""
STEADY, FLOOD = ("steady-a", "steady-b"), "flood"
INPUT_LEN, OUTPUT_LEN = 512, 128
MODES = ("alone", "fifo", "fair")
RATE_LIMITS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0)
"""The baseline a platform would reach for instead of a fair queue: each tenant limited to this
multiple of its fair share (a third of the fleet's capacity), excess refused at arrival, the
engines queueing the rest first come first served. Swept from half to three times the share
(three times lets the flood saturate the fleet again): the best and the cheapest settings
both lie inside."""
LIMIT_BURST_S = 1.0
"""The token bucket holds this many seconds of a tenant's limit (a short burst passes)."""
SWEPT_RESERVES = (0, 2, 4)
"""Reserves the fair queue also runs with (besides `RESERVE`): what a larger or no reserve
buys the steady tenants and costs the fleet."""


def _engine() -> EngineConfig:
    return EngineConfig.for_model(BUILTIN.model("llama-3.1-8b"), BUILTIN.gpu("h100"),
                                  tp_size=1, max_running_requests=SLOTS)  # fmt: skip


def tenant_arrivals(tenant: str, rate: float, seed: int, salt: int) -> list[Arrival]:
    n = max(1, round(rate * WINDOW_S))
    spec = WorkloadSpec("random", n, seed=seed * 101 + salt, input_len=INPUT_LEN,
                        output_len=OUTPUT_LEN, range_ratio=0.5)  # fmt: skip
    vocab = _engine().model.vocab_size
    drawn = Workload(spec, RateTrace("poisson", rate=rate), vocab)
    return [dataclasses.replace(a, tenant=tenant) for a in drawn if a.time < WINDOW_S]


def serve(arrivals: list[Arrival], gate: FleetGate | None) -> list[RequestRecord]:
    sim = routed_fleet(FleetConfig(_engine(), replicas=REPLICAS), "kvfleet", KvfleetTuning())
    sim.gate = gate
    return sim.run(Replay(arrivals)).records  # type: ignore[arg-type]


def fair_gate(reserve: int = RESERVE) -> FleetGate:
    """The gateway's fairness settings for this fleet: the engines' slots, the default
    reserve (unless swept), the product's default queue bounds and weights."""
    return FleetGate(Saturation(max_inflight_per_replica=SLOTS, reserve_per_replica=reserve),
                     max_waiting=1000, timeout_s=60.0)  # fmt: skip


def capacity(seed: int) -> float:
    """Requests per second the fleet finishes under a load it cannot keep up with."""
    flood = tenant_arrivals(FLOOD, 200.0, seed, salt=99)
    records = serve(flood, None)
    done = [r for r in records if WINDOW_S / 4 <= r.finish < WINDOW_S]
    return len(done) / (WINDOW_S * 3 / 4)


def rate_limited(arrivals: list[Arrival], rate: float) -> tuple[list[Arrival], int]:
    """One tenant's arrivals through a token bucket of `rate` requests per second holding
    `LIMIT_BURST_S` of them: those admitted, and how many were refused."""
    capacity = max(1.0, rate * LIMIT_BURST_S)
    tokens, last, kept = capacity, 0.0, []
    for a in arrivals:
        tokens = min(capacity, tokens + (a.time - last) * rate)
        last = a.time
        if tokens >= 1.0:
            tokens -= 1.0
            kept.append(a)
    return kept, len(arrivals) - len(kept)


def _limit_point(factor: float, cap: float, streams: dict[str, list[Arrival]],
                 seed: int) -> dict[str, Any]:  # fmt: skip
    """Per-tenant rate limits at `factor` × the fair share, FIFO behind them: the worse steady
    tenant's TTFT p99, each tenant's refusals and the fleet's output."""
    limited = {t: rate_limited(a, factor * cap / 3) for t, a in streams.items()}
    records = serve(_merge(*(kept for kept, _ in limited.values())), None)
    cells = cells_of("limits", records, seed, None)
    steady = [c for c in cells if c["tenant"] in STEADY]
    return {"factor": factor,
            "steady_ttft_p99": max(c["ttft_p99"] for c in steady),
            "refused": {t: n for t, (_, n) in limited.items()},
            "output_throughput": round(sum(c["output_throughput"] for c in cells), 1)}  # fmt: skip


def _merge(*streams: list[Arrival]) -> list[Arrival]:
    return list(heapq.merge(*streams, key=lambda a: a.time))


def cells_of(mode: str, records: list[RequestRecord], seed: int,
             gate: FleetGate | None) -> list[dict[str, Any]]:  # fmt: skip
    out = []
    tenants = sorted({r.tenant for r in records})
    for tenant in tenants:
        mine = [r for r in records if r.tenant == tenant and r.arrival >= WARMUP_S]
        done = sum(r.output_tokens for r in records
                   if r.tenant == tenant and WARMUP_S <= r.finish <= WINDOW_S)  # fmt: skip
        shed = sum(1 for s in gate.shed if s.arrival.tenant == tenant) if gate else 0
        waits = [w for t, who, w in gate.waits if who == tenant and t >= WARMUP_S] if gate else []
        out.append({"tenant": tenant, "mode": mode, "seed": seed,
                    "ttft_p99": round(percentile([r.ttft for r in mine], 99), 4),
                    "ttft_p50": round(percentile([r.ttft for r in mine], 50), 4),
                    "output_throughput": round(done / (WINDOW_S - WARMUP_S), 1),
                    "served": len(mine), "shed": shed,
                    "waited": round(sum(w > 0 for w in waits) / max(1, len(waits)), 4),
                    "wait_p99": round(percentile(waits, 99), 4) if waits else 0.0})  # fmt: skip
    return out


def run_seed(seed: int) -> dict[str, Any]:
    """One seed: the capacity, then alone (each steady tenant), FIFO and fair."""
    cap = capacity(seed)
    rates = {STEADY[0]: STEADY_SHARE * cap, STEADY[1]: STEADY_SHARE * cap,
             FLOOD: FLOOD_FACTOR * cap / 3}  # fmt: skip
    streams = {t: tenant_arrivals(t, r, seed, salt=i) for i, (t, r) in enumerate(rates.items())}
    cells: list[dict[str, Any]] = []
    for tenant in STEADY:
        gate = fair_gate()
        cells += cells_of("alone", serve(streams[tenant], gate), seed, gate)
    everyone = _merge(*streams.values())
    fifo = serve(everyone, None)
    cells += cells_of("fifo", fifo, seed, None)
    gate = fair_gate()
    fair = serve(everyone, gate)
    cells += cells_of("fair", fair, seed, gate)
    sweep = [_sweep_point(RESERVE, cells)]
    for reserve in SWEPT_RESERVES:
        gate = fair_gate(reserve)
        sweep.append(_sweep_point(reserve, cells_of("fair", serve(everyone, gate), seed, gate)))
    limits = [_limit_point(f, cap, streams, seed) for f in RATE_LIMITS]
    return {"seed": seed, "capacity": cap, "rates": rates, "cells": cells,
            "sweep": sorted(sweep, key=lambda p: p["reserve"]), "limits": limits,
            "service": {"fifo": _service(fifo), "fair": _service(fair)}}  # fmt: skip


def _sweep_point(reserve: int, cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The fair queue with `reserve` slots per replica: the worse steady tenant's TTFT p50 and
    p99 and share of requests that waited at the gateway, and the fleet's output."""
    fair = [c for c in cells if c["mode"] == "fair"]
    steady = [c for c in fair if c["tenant"] in STEADY]
    return {"reserve": reserve,
            "steady_ttft_p50": max(c["ttft_p50"] for c in steady),
            "steady_ttft_p99": max(c["ttft_p99"] for c in steady),
            "steady_waited": max(c["waited"] for c in steady),
            "output_throughput": round(sum(c["output_throughput"] for c in fair), 1)}  # fmt: skip


def _service(records: list[RequestRecord]) -> dict[str, list[tuple[float, int]]]:
    """Tenant → cumulative output tokens at each finish (each tenant's service over time)."""
    out: dict[str, list[tuple[float, int]]] = {}
    totals: dict[str, int] = {}
    for r in sorted(records, key=lambda r: r.finish):
        totals[r.tenant] = totals.get(r.tenant, 0) + r.output_tokens
        out.setdefault(r.tenant, []).append((r.finish, totals[r.tenant]))
    return out


def run_fairness_bench(log: Callable[[str], None], seeds: Sequence[int],
                       workers: int = 2) -> list[dict[str, Any]]:  # fmt: skip
    runs = []
    with ProcessPoolExecutor(workers) as pool:
        for run in pool.map(run_seed, seeds):
            runs.append(run)
            log(f"seed {run['seed']}: capacity {run['capacity']:.1f} req/s")
            for c in run["cells"]:
                log(f"  {c['mode']:5} {c['tenant']:9} TTFT p99 {c['ttft_p99'] * 1000:7.0f} ms,"
                    f" {c['output_throughput']:8.1f} tok/s, shed {c['shed']}")  # fmt: skip
    return runs


def dump_json(runs: list[dict[str, Any]]) -> str:
    keys = ("tenant", "mode", "ttft_p99", "output_throughput", "seed")
    return json.dumps({"cells": [{k: c[k] for k in keys} for r in runs for c in r["cells"]],
                       "reserve_sweep": [{**p, "seed": r["seed"]}
                                         for r in runs for p in r["sweep"]],
                       "rate_limits": [{**p, "seed": r["seed"]}
                                       for r in runs for p in r["limits"]]})  # fmt: skip
