"""`kvfleet bench autoscale`: the operator's scaling policy against KEDA and HPA tuned at their
best and against a hindsight oracle, in the fleet simulator, on traces that hurt — a 4× step,
a compressed day, a flash crowd, a steady noisy load — and on production traces in the Azure
LLM inference CSV and Mooncake JSONL formats.

Every cell runs one engine model (llama-3.1-8b on H100 through the simulator's cost model)
with a 180 s cold start, a 5 s promotion, decisions every 15 s and the SLO TTFT ≤ 2 s.

- **kvfleet** runs `kvfleet_operator.scaling.policy.decide` — the operator's function — with
  the spec a user would write: default windows and targets, `coldStartSeconds: 180`,
  `slo.ttftSeconds: 2`, `warmPool: auto` over a floor of one spare. It learns the capacity
  of a replica from the run itself; nothing in it comes from this simulator.
- **keda** (waiting + running per replica) is swept over thresholds, **hpa** (GPU
  utilization) over its target (`HPA_TARGETS`, bracketing its shipped 80%); each also with a
  static warm floor (`minReplicas` + 1, the spare kvfleet keeps). The sweep runs on the
  first seed; the point with the best SLO attainment at no more GPU-hours than kvfleet runs
  on every seed.
- **static** (step and flash): the smallest fixed fleet that keeps 99% within the SLO —
  the price a policy that cannot see the surge coming pays to meet it.
- **oracle** knows every arrival (`scalers.OracleScaler`) and plans at the headroom that
  keeps ≥ 99.9% of requests within the SLO for the fewest GPU-hours on each seed (below 1
  where a fleet's shared load lets a replica serve more than one alone measures), or it is
  reported broken; and broken too when any other policy keeps 99.9% for fewer.

Every policy starts sized for the load of its first cold start (`initial_size`): none can
add a replica sooner. Synthetic traces run 3 seeds; a trace file's arrivals are the file's,
so it runs once.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvfleet_operator.scaling.model import Decision, ScalingConfig
from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig
from kvfleet_sim.fleet.collector import percentile
from kvfleet_sim.fleet.des import FleetSimulator
from kvfleet_sim.fleet.model import FleetConfig, FleetResult, Scaler
from kvfleet_sim.fleet.routing import fleet_policy
from kvfleet_sim.fleet.scalers import (
    KvfleetScaler,
    OracleScaler,
    StaticScaler,
    hpa_util,
    keda_load,
)
from kvfleet_sim.fleet.tracefile import TraceFileWorkload, TraceRow, read_trace
from kvfleet_sim.fleet.traces import RateTrace, thinned
from kvfleet_sim.fleet.workloads import Workload, WorkloadSpec

SLO_TTFT_S = 2.0
COLD_START_S = 180.0
PROMOTION_S = 5.0
DURATION_S = 1500.0
STEADY_S = 1800.0
SPIKE_AT_S = 600.0
"""Ten minutes of steady load first: every policy reaches its steady size (its scale-down
window has passed) before the spike, so no one profits from a scale-up the warm-up left."""
MAX_REPLICAS = 12
"""The fleet's maximum, unless a trace's peak asks for more (`max_replicas`)."""
PEAK_COVER = 2.0
"""A cell's maximum covers this many times its peak 15 s rate at the measured capacity: a
user sets maxReplicas above the peak, so the policy, not the cap, decides the fleet."""
GPU_HOURLY_PRICE = 2.50
"""Assumed on-demand price of one H100-hour for the cost column (a report assumption)."""
LONG_PROMPT = "long-prompt"
"""Qwen3-32B on two H100s (TP2), prompts of 8–16k tokens, on the diurnal shape: a cell whose
replica serves a few requests per second, bound by prefill."""
TRACES = ("step", "diurnal", "flash", "steady", LONG_PROMPT)
POLICIES = ("kvfleet", "hpa", "keda", "oracle")
PLANNED = ("oracle", "static")
"""Policies run at a headroom the bench chose (shown beside them)."""
STATIC_REFERENCE = ("step", "flash")
"""Traces whose surge no causal policy sees coming: a fleet kept at the peak size all along
runs beside them, as the price of meeting the surge without foresight."""
HPA_TARGETS = (0.5, 0.6, 0.7, 0.8, 0.9)
"""HPA's utilization targets swept (`hpa@T`; plain `hpa` is its usual 0.8)."""
KEDA_THRESHOLDS = (10, 20, 30, 40, 50, 60)
"""Waiting + running requests per replica (one replica runs ~57 at its SLO capacity)."""
HEADROOMS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5)
"""The oracle's and the static fleet's planned capacity per unit of rate, tried from 1."""
SEEDS = (1, 2, 3)
ORACLE_SLO = 0.999
STATIC_SLO = 0.99
"""The static reference is the smallest fixed fleet that keeps kvfleet's goal."""
WORKLOAD = WorkloadSpec("random", input_len=1024, output_len=256, range_ratio=0.5)
MAX_PROMPT = 8192


@dataclass(frozen=True)
class Deployment:
    """What a cell serves: the engine, its requests' lengths, the SLO and KEDA's grid."""

    model: str
    tp_size: int
    workload: WorkloadSpec
    slo_ttft_s: float
    keda_thresholds: tuple[int, ...]

    def engine(self) -> EngineConfig:
        return EngineConfig(
            model=BUILTIN.model(self.model), gpu=BUILTIN.gpu("h100"), tp_size=self.tp_size
        )


LLAMA_8B = Deployment("llama-3.1-8b", 1, WORKLOAD, SLO_TTFT_S, KEDA_THRESHOLDS)
QWEN_32B_LONG = Deployment(
    "qwen3-32b",
    2,
    WorkloadSpec("random", input_len=16384, output_len=256, range_ratio=0.5),
    6.0,  # prefilling 16k tokens on a 32B model takes seconds by itself
    (2, 4, 6, 8, 12),  # its replica runs a handful of requests at its SLO capacity
)


def deployment(trace: str = "") -> Deployment:
    return QWEN_32B_LONG if trace == LONG_PROMPT else LLAMA_8B


def rate_trace(kind: str, capacity: float, seed: int = 1) -> RateTrace | NoisyRate:
    """Traces in units of one replica's capacity: the base keeps ~1.2 replicas busy."""
    base = 1.2 * capacity
    if kind == "step":  # 4× for five minutes
        return RateTrace("step", rate=base, peak_rate=4 * base, start_s=SPIKE_AT_S, duration_s=300)
    if kind in ("diurnal", LONG_PROMPT):  # night to noon and back, compressed into the run
        return RateTrace("diurnal", rate=0.3 * base, peak_rate=4 * base, period_s=DURATION_S)
    if kind == "flash":  # six times the base at once, thinning out over two minutes
        return RateTrace("flash", rate=base, peak_rate=6 * base, start_s=SPIKE_AT_S, decay_s=120)
    if kind == "steady":  # 2.5 replicas' worth, ±20% from one minute to the next
        return NoisyRate(2.5 * capacity, 0.2, 60.0, seed)
    raise ValueError(f"unknown trace {kind!r}")


@dataclass(frozen=True)
class NoisyRate:
    """A steady mean rate whose level moves at random every `period_s` (a noisy plateau)."""

    rate: float
    spread: float
    period_s: float
    seed: int

    def rate_at(self, t: float) -> float:
        rng = random.Random(self.seed * 1_000_003 + int(t // self.period_s))
        return self.rate * rng.uniform(1 - self.spread, 1 + self.spread)

    def max_rate(self) -> float:
        return self.rate * (1 + self.spread)

    def expected_requests(self, duration_s: float) -> int:
        return int(sum(self.rate_at(t + 0.5) for t in range(int(duration_s))))

    def arrivals(self, n: int, rng: random.Random) -> list[float]:
        return thinned(self.rate_at, self.max_rate(), n, rng)


def _rows_at_rate(rows: list[TraceRow], rate: float, n: int, seed: int) -> list[TraceRow]:
    """The file's requests (lengths, prefixes) arriving as a Poisson process at `rate`."""
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        r = rows[i % len(rows)]
        out.append(TraceRow(t, r.prompt_tokens, r.output_tokens, r.hash_ids))
    return out


def measure_capacity(trace_file: str | None = None, seed: int = 1, trace: str = "") -> float:
    """Requests per second one replica serves with TTFT p99 within the SLO (bisection), on
    the workload's own token mix: the synthetic spec (`trace`'s engine and lengths), or a
    trace file's requests. At least `CAPACITY_REQUESTS` of them a point: a p99 of fifty
    requests is their slowest one."""
    vocab = deployment(trace).engine().model.vocab_size
    rows = read_trace(Path(trace_file), MAX_PROMPT) if trace_file else None

    def keeps_slo(rate: float) -> bool:
        n = max(CAPACITY_REQUESTS, int(rate * 120))
        wl: Workload
        if rows is not None:
            wl = TraceFileWorkload(_rows_at_rate(rows, rate, n, seed), vocab, seed=seed)
        else:
            spec = replace(deployment(trace).workload, num_requests=n, seed=seed)
            wl = Workload(spec, RateTrace("poisson", rate=rate), vocab)
        one = FleetConfig(deployment(trace).engine(), replicas=1)
        result = FleetSimulator(one, fleet_policy("kvfleet")).run(wl)
        return result.summary.ttft_p99 <= deployment(trace).slo_ttft_s

    return highest_passing(keeps_slo, 0.05, 200.0)


CAPACITY_REQUESTS = 300
"""Requests per bisection point of `measure_capacity`, at least."""


def highest_passing(passes: Callable[[float], bool], lo: float, hi: float,
                    steps: int = 12) -> float:  # fmt: skip
    """The highest rate in [lo, hi] that `passes` (assumed to hold under some rate and fail
    over it), within a relative step of (hi/lo)^(1/2^steps): a geometric bisection, as
    precise for a replica serving half a request a second as for one serving fifty (a
    linear one over 0.05–200 req/s ends 0.2 req/s wide, 40% of the smaller)."""
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class Cell:
    trace: str
    policy: str
    """kvfleet | hpa | hpa+1 | keda@T | keda@T+1 | static | oracle"""
    seed: int
    capacity: float
    trace_file: str | None = None
    time_scale: float = 1.0
    rate_scale: float = 1.0
    headroom: float = 1.0
    """The oracle's and the static fleet's: capacity planned per unit of rate."""


def peak_rate(rate_at: Callable[[float], float], duration: float) -> float:
    """The trace's highest rate, over points 5 s apart."""
    return max(rate_at(float(t)) for t in range(0, int(duration) + 1, 5))


def max_replicas(cell: Cell, rate_at: Callable[[float], float], duration: float) -> int:
    """The cell's maxReplicas: `MAX_REPLICAS`, or `PEAK_COVER` times the replicas the
    trace's peak needs at the measured capacity when that is more (a trace file scaled past
    twelve replicas' worth would otherwise measure the cap, every policy pinned at it)."""
    need = PEAK_COVER * peak_rate(rate_at, duration) / cell.capacity
    return max(MAX_REPLICAS, math.ceil(need - 1e-9))


def _scaler(cell: Cell, rate_at: Callable[[float], float],
            maximum: int = MAX_REPLICAS) -> tuple[Scaler, bool]:  # fmt: skip
    """The scaler of a cell, and whether new replicas start warm."""
    name, _, floor = cell.policy.partition("+")
    minimum = 1 + int(floor or 0)
    if name == "kvfleet":
        config = ScalingConfig(
            min_replicas=1,
            max_replicas=maximum,
            warm_replicas=1,
            warm_auto=True,
            cold_start_s=COLD_START_S,  # the spec's coldStartSeconds a user would set
            slo_ttft_s=deployment(cell.trace).slo_ttft_s,  # the spec's slo.ttftSeconds
        )
        return KvfleetScaler(config), True
    if name == "hpa":
        return hpa_util(minimum, maximum), False
    if name.startswith("hpa@"):
        return hpa_util(minimum, maximum, float(name[4:])), False
    if name.startswith("keda@"):
        return keda_load(minimum, maximum, float(name[5:])), False
    if name == "static":
        return StaticScaler(static_size(cell, rate_at, maximum)), False
    if name == "oracle":
        lead = COLD_START_S
        oracle = OracleScaler(rate_at, cell.capacity, lead, 1, maximum, 15.0, cell.headroom)
        return oracle, False
    raise ValueError(f"unknown policy {cell.policy!r}")


def static_size(cell: Cell, rate_at: Callable[[float], float],
                maximum: int = MAX_REPLICAS) -> int:  # fmt: skip
    """A fixed fleet for the trace's peak rate (over 5 s points) at the measured capacity."""
    peak = peak_rate(rate_at, STEADY_S)
    return max(1, min(maximum, math.ceil(peak * cell.headroom / cell.capacity - 1e-9)))


def initial_size(cell: Cell, rate_at: Callable[[float], float]) -> int:
    """Every policy starts sized for the load of its first cold start, as a user deploying
    into live traffic sizes it, at the measured capacity (the oracle at its headroom). No
    policy can add a replica sooner than one cold start: a start sized on the first seconds
    alone cost every reactive policy the same first minutes on a trace file whose rate rises
    in them (all of them read 90.39% within the SLO on the synthetic chat trace), whatever
    its policy."""
    first = max(rate_at(float(t)) for t in range(0, int(COLD_START_S) + 16, 5))
    headroom = cell.headroom if cell.policy == "oracle" else 1.0
    return max(1, math.ceil(first * headroom / cell.capacity - 1e-9))


def _workload(cell: Cell) -> tuple[Workload, Callable[[float], float], float]:
    vocab = deployment(cell.trace).engine().model.vocab_size
    if cell.trace_file:
        rows = read_trace(Path(cell.trace_file), max_prompt_tokens=MAX_PROMPT)
        wl = TraceFileWorkload(rows, vocab, cell.time_scale, cell.rate_scale, cell.seed)
        times = sorted(r.time / cell.time_scale for r in rows)

        def rate_at(t: float) -> float:  # the file's own rate over 15 s (for the oracle)
            lo = _bisect(times, t - 7.5)
            return cell.rate_scale * (_bisect(times, t + 7.5) - lo) / 15.0

        return wl, rate_at, wl.duration_s
    trace = rate_trace(cell.trace, cell.capacity, cell.seed)
    duration = STEADY_S if cell.trace == "steady" else DURATION_S
    spec = replace(
        deployment(cell.trace).workload,
        num_requests=trace.expected_requests(duration),
        seed=cell.seed,
    )
    return Workload(spec, trace, vocab), trace.rate_at, duration


def _bisect(xs: list[float], x: float) -> int:
    import bisect

    return bisect.bisect_left(xs, x)


def run_cell(cell: Cell) -> dict[str, Any]:
    workload, rate_at, duration = _workload(cell)
    maximum = max_replicas(cell, rate_at, duration)
    scaler, warm_start = _scaler(cell, rate_at, maximum)
    initial = scaler.size if isinstance(scaler, StaticScaler) else initial_size(cell, rate_at)
    initial = min(initial, maximum)
    config = FleetConfig(
        deployment(cell.trace).engine(),
        replicas=initial,
        cold_start_s=COLD_START_S,
        scale_interval_s=15.0,
        promotion_s=PROMOTION_S,
        warm_start=warm_start,
    )
    result: FleetResult = FleetSimulator(config, fleet_policy("kvfleet"), scaler).run(workload)
    return {**_summarize(cell, result, rate_at, duration, scaler), "max_replicas": maximum}


def _summarize(cell: Cell, result: FleetResult, rate_at: Callable[[float], float],
               duration: float, scaler: Scaler) -> dict[str, Any]:  # fmt: skip
    records = result.records
    ttfts = [r.ttft for r in records]
    gpu_hours = result.summary.gpu_seconds / 3600.0
    sizes = [a + w + s for _, a, w, s in result.roles_trace]
    # A size change: the fleet's decided total moving (not a pod turning ready or a role).
    decided = [d.desired_total for _, d in getattr(scaler, "decisions", [])]
    changes = sum(1 for a, b in itertools.pairwise(decided) if a != b)
    if not decided:
        changes = sum(1 for a, b in itertools.pairwise(sizes) if a != b)
    diagnosis = _diagnosis(getattr(scaler, "decisions", []), rate_at, duration)
    buckets = int(duration // 30) + 1
    p99_timeline: list[float] = []
    for b in range(buckets):
        window = [r.ttft for r in records if b * 30 <= r.arrival < (b + 1) * 30]
        p99_timeline.append(percentile(window, 99) if window else 0.0)
    return {
        "trace": cell.trace,
        "label": cell.policy,
        "seed": cell.seed,
        "headroom": cell.headroom,
        "measured_capacity": cell.capacity,
        "requests": len(records),
        "slo_attainment": sum(1 for t in ttfts if t <= deployment(cell.trace).slo_ttft_s)
        / max(1, len(ttfts)),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "gpu_hours": gpu_hours,
        "cost_per_1k": gpu_hours * GPU_HOURLY_PRICE / max(1, len(records)) * 1000,
        "changes_per_hour": changes * 3600.0 / max(1.0, duration),
        "roles": [(round(t, 1), a, w, s) for t, a, w, s in result.roles_trace],
        "rate": [rate_at(t) for t in range(0, int(duration) + 1, 10)],
        "ttft_p99_timeline": p99_timeline,
        **diagnosis,
    }


def _diagnosis(decisions: Sequence[tuple[float, Decision]], rate_at: Callable[[float], float],
               duration: float) -> dict[str, float]:  # fmt: skip
    """Where a kvfleet fleet's GPU-hours go: its capacity plan per replica and the gateways'
    roofline (medians over the decisions that had one), its highest forecast over the trace's
    highest rate, and its mean warm spares (nothing for a policy without decisions)."""
    if not decisions:
        return {}
    plans = [d.capacity_per_replica for _, d in decisions if d.capacity_per_replica]
    rooflines = [d.replica_throughput for _, d in decisions if d.replica_throughput]
    forecasts = [d.forecast_rate for _, d in decisions if d.forecast_rate is not None]
    peak = peak_rate(rate_at, duration)
    out = {"warm_mean": statistics.fmean(d.desired_warm for _, d in decisions)}
    if plans:
        out["capacity_plan"] = statistics.median(plans)
    if rooflines:
        out["roofline"] = statistics.median(rooflines)
    if forecasts and peak > 0:
        out["forecast_over_peak"] = max(forecasts) / peak
    return out


@dataclass(frozen=True)
class Plan:
    traces: Sequence[str]
    seeds: Sequence[int]
    trace_files: Sequence[Path]
    time_scale: float
    rate_scale: float
    policies: Sequence[str] = POLICIES


def _pool_map(fn: Callable[[Cell], dict[str, Any]], cells: list[Cell], workers: int,
              log: Callable[[str], None]) -> list[dict[str, Any]]:  # fmt: skip
    out: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for r in pool.map(fn, cells):
            out.append(r)
            log(
                f"  {r['trace']:<24} {r['label']:<12} seed {r['seed']}: SLO "
                f"{r['slo_attainment']:.2%}, {r['gpu_hours']:.2f} GPU-h"
                + (f" (headroom {r['headroom']:g})" if r["label"] in PLANNED else "")
            )
    return out


def _cheapest_headroom(base: list[Cell], run: Callable[[list[Cell]], list[dict[str, Any]]],
                       goal: float = ORACLE_SLO) -> list[dict[str, Any]]:  # fmt: skip
    """Each cell (the oracle, or the static fleet) at the headroom of `HEADROOMS` that keeps
    `goal` within the SLO for the fewest GPU-hours. From 1 it goes down the grid while the
    goal holds (a fleet shares its replicas' load: it serves more per replica than one
    replica alone, the measured capacity) and up it until the goal holds (the highest tried
    when none does: the oracle is then reported broken). `run` runs a round of cells."""
    tried: list[list[dict[str, Any]]] = [[] for _ in base]
    todo = [(i, HEADROOMS.index(1.0), 0) for i in range(len(base))]  # (cell, grid point, way)
    while todo:
        results = run([replace(base[i], headroom=HEADROOMS[k]) for i, k, _ in todo])
        again = []
        for (i, k, way), r in zip(todo, results, strict=True):
            tried[i].append(r)
            kept = r["slo_attainment"] >= goal
            way = way or (-1 if kept else 1)
            onward = kept if way < 0 else not kept
            if onward and 0 <= k + way < len(HEADROOMS):
                again.append((i, k + way, way))
        todo = again
    out = []
    for results in tried:
        kept = [r for r in results if r["slo_attainment"] >= goal]
        out.append(min(kept, key=lambda r: r["gpu_hours"]) if kept else results[-1])
    return out


def _cells(plan: Plan) -> list[tuple[str, str | None, list[int]]]:
    """(trace name, file, seeds) of the run."""
    out: list[tuple[str, str | None, list[int]]] = [
        (t, None, list(plan.seeds)) for t in plan.traces
    ]
    out += [(f"file:{f.name}", str(f), [plan.seeds[0]]) for f in plan.trace_files]
    return out


def run_autoscale_bench(
    out_dir: Path, log: Callable[[str], None], plan: Plan, workers: int = 2
) -> dict[str, Any]:
    from kvfleet_bench.autoscale_report import best_points, goals, write_report

    log("measuring one replica's capacity within the SLO on each workload ...")
    capacity = {"synthetic": measure_capacity()}
    if LONG_PROMPT in plan.traces:
        capacity[LONG_PROMPT] = measure_capacity(trace=LONG_PROMPT)
    for f in plan.trace_files:
        capacity[f.name] = measure_capacity(str(f))
    for k, v in capacity.items():
        log(f"  {k}: {v:.2f} requests/s per replica with TTFT p99 ≤ {deployment(k).slo_ttft_s:g} s")
    results: list[dict[str, Any]] = []

    def rounds(cells: list[Cell]) -> list[dict[str, Any]]:
        return _pool_map(run_cell, cells, workers, log)

    for trace, file, seeds in _cells(plan):
        cap = capacity[Path(file).name] if file else capacity.get(trace, capacity["synthetic"])
        scale = (plan.time_scale, plan.rate_scale) if file else (1.0, 1.0)

        def cell(policy: str, seed: int, t: str = trace, f: str | None = file,
                 c: float = cap, s: tuple[float, float] = scale) -> Cell:  # fmt: skip
            return Cell(t, policy, seed, c, f, s[0], s[1])

        log(f"{trace}:")
        results += _pool_map(run_cell, [cell("kvfleet", s) for s in seeds], workers, log)
        if trace == "steady":
            continue  # the flapping check: kvfleet's size changes on a noisy plateau
        if "oracle" in plan.policies:
            results += _cheapest_headroom([cell("oracle", s) for s in seeds], rounds)
        if trace in STATIC_REFERENCE:
            statics = [cell("static", s) for s in seeds]
            results += _cheapest_headroom(statics, rounds, goal=STATIC_SLO)
        sweep = [p for p in ("hpa", "keda") if p in plan.policies]
        names = [f"{b}{fl}" for b in _baselines(sweep, trace) for fl in ("", "+1")]
        first = _pool_map(run_cell, [cell(n, seeds[0]) for n in names], workers, log)
        for r in first:
            r["sweep"] = True
        results += first
        kv = [r for r in results if r["trace"] == trace and r["label"] == "kvfleet"]
        best = best_points(first, sum(r["gpu_hours"] for r in kv) / len(kv))
        rest = [cell(label, s) for label in best for s in seeds[1:]]
        results += _pool_map(run_cell, rest, workers, log)
    checks = goals(results)
    write_report(out_dir, results, checks, capacity, plan)
    return {"capacity": capacity, "results": results, "goals": checks}


def _baselines(names: Sequence[str], trace: str) -> list[str]:
    out: list[str] = []
    for n in names:
        if n == "keda":
            out += [f"keda@{t}" for t in deployment(trace).keda_thresholds]
        elif n == "hpa":
            out += [f"hpa@{t:g}" for t in HPA_TARGETS]
        else:
            out.append(n)
    return out


def cells_json(result: dict[str, Any]) -> str:
    keys = ("trace", "label", "seed", "slo_attainment", "ttft_p99", "gpu_hours", "cost_per_1k")
    return json.dumps({"cells": [{k: r[k] for k in keys} for r in result["results"]]})
