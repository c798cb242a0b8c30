"""`kvfleet bench pd`: colocated vs prefill/decode-disaggregated serving at equal GPU count.

Eight H100s serve Llama-3.1-8B (one GPU per engine) either as eight colocated engines routed
by the shipped kvfleet policy, or as P prefill + D decode engines (P:D from 2:6 to 6:2)
paired as the shipped gateway pairs them (kvfleet policy for prefill, least load for decode),
with the KV crossing 400 Gb/s InfiniBand or 100 Gb/s Ethernet. The measure is DistServe's
**goodput**: the highest Poisson request rate at which at least 90% of requests meet both a
TTFT SLO and a time-per-output-token SLO (searched by doubling, then bisection). Workloads: a
prefill-heavy one (8k-token prompts, 128-token answers), a decode-heavy one (512 → 1,024) and
the Mooncake-format trace file's requests (their lengths and shared prefixes). The SLOs are
stated per workload and were not tuned to any result.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet_bench.common import Replay
from kvfleet_gateway.routing import KvfleetTuning
from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig
from kvfleet_sim.fleet.collector import RequestRecord
from kvfleet_sim.fleet.model import FleetConfig
from kvfleet_sim.fleet.pd import PdFleet, PdFleetConfig
from kvfleet_sim.fleet.routing import make_policy, routed_fleet
from kvfleet_sim.fleet.tracefile import TraceFileWorkload, read_trace
from kvfleet_sim.fleet.traces import RateTrace
from kvfleet_sim.fleet.workloads import Arrival, Workload, WorkloadSpec

GPUS = 8
MODEL, GPU = "llama-3.1-8b", "h100"
RATIOS = ((2, 6), (3, 5), (4, 4), (5, 3), (6, 2))
LINKS = ("ib400", "eth100")
"""Catalogue links (the simulator's `links:`) the KV crosses in the PD shapes."""
ATTAINMENT = 0.9
"""DistServe's goodput: the rate at which this share of requests meets both SLOs."""
MOONCAKE = Path(__file__).parent / "data" / "mooncake-sample.jsonl"


@dataclass(frozen=True)
class PdWorkload:
    name: str
    ttft_slo_s: float
    tpot_slo_s: float
    input_len: int = 0
    output_len: int = 0
    trace_file: Path | None = None


WORKLOADS = (
    # Long documents, short answers: a tight TPOT (an 8B decode step is ~10 ms unloaded).
    PdWorkload("prefill-heavy", ttft_slo_s=2.0, tpot_slo_s=0.025, input_len=8192, output_len=128),
    # Chat with long answers: prefill is cheap, decode is the work.
    PdWorkload("decode-heavy", ttft_slo_s=1.0, tpot_slo_s=0.05, input_len=512, output_len=1024),
    # The trace file's mix (median 3.7k-token prompts, ~220-token answers).
    PdWorkload("mooncake", ttft_slo_s=2.0, tpot_slo_s=0.05, trace_file=MOONCAKE),
)


@dataclass(frozen=True)
class Shape:
    mode: str
    """colocated | pd"""
    prefill: int = 0
    decode: int = 0
    link: str | None = None

    @property
    def ratio(self) -> str | None:
        return f"{self.prefill}:{self.decode}" if self.mode == "pd" else None

    @property
    def label(self) -> str:
        return "colocated" if self.mode == "colocated" else f"PD {self.ratio} {self.link}"


SHAPES = (
    Shape("colocated"),
    *(Shape("pd", p, d, link) for link in LINKS for p, d in RATIOS),
)


def _engine() -> EngineConfig:
    return EngineConfig.for_model(BUILTIN.model(MODEL), BUILTIN.gpu(GPU), tp_size=1)


WINDOW_S = 30.0
"""Seconds of arrivals per trial: goodput is a sustained rate, not a burst absorbed."""
MIN_REQUESTS = 100


def arrivals(wl: PdWorkload, rate: float, seed: int) -> list[Arrival]:
    """WINDOW_S of Poisson arrivals at `rate` (at least MIN_REQUESTS). The trace workload
    keeps its file's requests (lengths, shared prefixes), in order and cyclically, at these
    times."""
    vocab = BUILTIN.model(MODEL).vocab_size
    n = max(MIN_REQUESTS, math.ceil(rate * WINDOW_S))
    rng = random.Random(seed)
    if wl.trace_file is not None:
        rows = read_trace(wl.trace_file)
        times = itertools.accumulate(rng.expovariate(rate) for _ in range(n))
        timed = [dataclasses.replace(rows[i % len(rows)], time=t) for i, t in enumerate(times)]
        return list(TraceFileWorkload(timed, vocab, seed=seed))
    spec = WorkloadSpec("random", n, seed=seed, input_len=wl.input_len,
                        output_len=wl.output_len, range_ratio=1.0)  # fmt: skip
    return list(Workload(spec, RateTrace("poisson", rate=rate), vocab))


def serve(shape: Shape, reqs: list[Arrival]) -> tuple[list[RequestRecord], list[float]]:
    """The records of `reqs` served by `shape` (and each request's KV transfer time)."""
    engine = _engine()
    if shape.mode == "colocated":
        sim = routed_fleet(FleetConfig(engine, replicas=GPUS), "kvfleet", KvfleetTuning())
        return sim.run(Replay(reqs)).records, []  # type: ignore[arg-type]
    assert shape.link is not None
    config = PdFleetConfig(engine, engine, shape.prefill, shape.decode, BUILTIN.link(shape.link))
    result = PdFleet(config, make_policy("kvfleet"), make_policy("least_load")).run(reqs)
    return result.records, result.transfer_s


def attainment(records: list[RequestRecord], wl: PdWorkload) -> float:
    ok = sum(r.ttft <= wl.ttft_slo_s and r.tpot <= wl.tpot_slo_s for r in records)
    return ok / len(records)


def goodput(shape: Shape, wl: PdWorkload, seed: int, steps: int = 4) -> dict[str, Any]:
    """The highest rate meeting the SLOs for ATTAINMENT of requests, and the numbers there."""

    def trial(rate: float) -> tuple[float, list[RequestRecord], list[float]]:
        records, transfers = serve(shape, arrivals(wl, rate, seed))
        return attainment(records, wl), records, transfers

    lo, hi, best = 0.0, 2.0, None
    while True:  # double until the SLOs fail
        att, records, transfers = trial(hi)
        if att < ATTAINMENT or hi > 4096:
            break
        lo, best = hi, (records, transfers)
        hi *= 2
    for _ in range(steps):
        mid = (lo + hi) / 2
        att, records, transfers = trial(mid)
        if att >= ATTAINMENT:
            lo, best = mid, (records, transfers)
        else:
            hi = mid
    records, transfers = best if best is not None else trial(max(lo, 0.25))[1:]
    ttfts = sorted(r.ttft for r in records)
    tpots = sorted(r.tpot for r in records)
    e2e = [r.finish - r.arrival for r in records]
    return {
        "goodput": round(lo, 3),
        "ttft_p99": round(_p99(ttfts), 4),
        "itl_p99": round(_p99(tpots), 5),
        "transfer_share": round(sum(transfers) / sum(e2e), 4) if transfers else 0.0,
    }


def _p99(xs: list[float]) -> float:
    return xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]


def _cell(args: tuple[Shape, PdWorkload, int]) -> dict[str, Any]:
    shape, wl, seed = args
    found = goodput(shape, wl, seed)
    return {"workload": wl.name, "mode": shape.mode, "ratio": shape.ratio, "gpus": GPUS,
            "link": shape.link, "seed": seed, **found}  # fmt: skip


def run_pd_bench(
    log: Callable[[str], None],
    *,
    workloads: Sequence[PdWorkload] = WORKLOADS,
    seeds: Sequence[int] = (1, 2, 3),
    workers: int = 2,
) -> list[dict[str, Any]]:
    jobs = [(s, wl, seed) for wl in workloads for seed in seeds for s in SHAPES]
    cells: list[dict[str, Any]] = []
    with ProcessPoolExecutor(workers) as pool:
        for cell in pool.map(_cell, jobs):
            cells.append(cell)
            log(f"{cell['workload']} seed {cell['seed']} {_label(cell)}: goodput "
                f"{cell['goodput']:g} req/s, TTFT p99 {cell['ttft_p99']:.2f} s, TPOT p99 "
                f"{cell['itl_p99'] * 1000:.1f} ms")  # fmt: skip
    return cells


def _label(cell: dict[str, Any]) -> str:
    return "colocated" if cell["mode"] == "colocated" else f"PD {cell['ratio']} {cell['link']}"


def summarize(cells: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """(workload, shape label) → mean, min and max goodput over seeds."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    groups: dict[tuple[str, str], list[float]] = {}
    for c in cells:
        groups.setdefault((c["workload"], _label(c)), []).append(float(c["goodput"]))
    for key, values in groups.items():
        out[key] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
    return out


def dump_json(cells: list[dict[str, Any]]) -> str:
    keys = ("workload", "mode", "ratio", "gpus", "link", "goodput", "ttft_p99", "itl_p99", "seed")
    return json.dumps({"cells": [{k: c[k] for k in keys} for c in cells]})
