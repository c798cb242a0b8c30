"""`kvfleet bench routing-tuning`: the kvfleet policy's one hand-set constant, `missWeight`,
swept on workloads and a deployment the routing report does not show, so the report does not
score a constant chosen on its own cells.

Held out: the inference-perf shared-prefix file's data
(`bench/kvfleet_bench/data/inference-perf-shared-prefix.yaml`, Poisson at one rate), which the
report does not replay, and multi-turn chat, both on 4 replicas of Llama-3.1-70B at TP4 on H200
(the report runs 8 replicas of an 8B model on H100), seeds 11–13 (the report uses 1–3).
Prompts without shared prefixes do not depend on the weight at all (`random`: identical
TTFT at every weight), so they are left out.
Score: TTFT p99 at 80% and 95% of each workload's capacity, relative to the best weight in
the same cell, averaged; lower is better.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import fmean
from typing import Any

from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig
from kvfleet_sim.fleet.model import FleetConfig
from kvfleet_sim.fleet.routing import KvfleetTuning, routed_fleet
from kvfleet_sim.fleet.traces import RateTrace
from kvfleet_sim.fleet.workload_file import load_workload_file
from kvfleet_sim.fleet.workloads import Workload, WorkloadSpec

WEIGHTS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
"""Doubling steps past the default on both sides: the best must lie inside the grid, not at its
edge (else the grid says only that the optimum is further out)."""
LOADS = (0.8, 0.95)
SEEDS = (11, 12, 13)
WORKLOAD_FILE = Path(__file__).parent / "data" / "inference-perf-shared-prefix.yaml"


def _held_out_specs(n: int, seed: int) -> dict[str, WorkloadSpec]:
    wf = load_workload_file(WORKLOAD_FILE, seed)
    return {
        "multi-turn": WorkloadSpec("multi-turn", n, seed=seed),
        "inference-perf shared prefix": dataclasses.replace(wf.spec, num_requests=n),
    }


def _run(config: FleetConfig, spec: WorkloadSpec, rate: float, policy: str, w: float) -> Any:
    """`rate` in requests/s (a multi-turn conversation arrives once for all its turns)."""
    sim = routed_fleet(config, policy, KvfleetTuning(miss_weight=w))
    arrivals = rate / spec.turns if spec.kind == "multi-turn" else rate
    vocab = config.engine.model.vocab_size
    return sim.run(Workload(spec, RateTrace("poisson", rate=arrivals), vocab)).summary


def _p99(config: FleetConfig, spec: WorkloadSpec, rate: float, w: float) -> float:
    return float(_run(config, spec, rate, "kvfleet", w).ttft_p99)


def _capacity(config: FleetConfig, spec: WorkloadSpec) -> float:
    flood = 4000.0 if spec.kind == "multi-turn" else 1000.0
    return float(_run(config, spec, flood, "round_robin", 0.0).request_throughput)


def bracket_note(weights: Sequence[float], chosen: float) -> str:
    """Whether the grid brackets its best: a best at the grid's edge says only that the
    optimum lies further out."""
    if min(weights) < chosen < max(weights):
        return f"inside the grid ({min(weights):g}–{max(weights):g}), which brackets it."
    return f"at the grid's edge ({min(weights):g}–{max(weights):g}): the optimum may lie beyond."


def sweep_miss_weight(
    out_dir: Path,
    log: Callable[[str], None],
    *,
    num_requests: int = 1000,
    weights: Sequence[float] = WEIGHTS,
    seeds: Sequence[int] = SEEDS,
) -> dict[str, Any]:
    engine = EngineConfig.for_model(BUILTIN.model("llama-3.1-70b"), BUILTIN.gpu("h200"), tp_size=4)
    config = FleetConfig(engine, replicas=4)
    rows: list[dict[str, Any]] = []
    for seed in seeds:
        for name, spec in _held_out_specs(num_requests, seed).items():
            cap = _capacity(config, spec)
            for load in LOADS:
                p99s = {w: _p99(config, spec, load * cap, w) for w in weights}
                best = min(p99s.values())
                rows.append({"workload": name, "seed": seed, "load": load, "p99": p99s,
                             "relative": {w: p / best for w, p in p99s.items()}})  # fmt: skip
                log(f"  {name} seed {seed} {load:.0%} of {cap:.1f} req/s: " + ", ".join(
                    f"{w:g}: {p * 1000:.0f} ms" for w, p in p99s.items()))  # fmt: skip
    score = {w: fmean(r["relative"][w] for r in rows) for w in weights}
    worst = {w: max(r["relative"][w] for r in rows) for w in weights}
    chosen = min(score, key=lambda w: score[w])
    lines = [
        "# kvfleet's missWeight, chosen on held-out workloads",
        "",
        "Produced by `kvfleet bench routing-tuning`. " + (__doc__ or "").split("\n\n")[1].strip(),
        "",
        f"Default `missWeight`: {KvfleetTuning().miss_weight:g}; best here: {chosen:g}; "
        + bracket_note(weights, chosen),
        "",
        "| missWeight | mean TTFT p99 ÷ best | worst cell ÷ best |",
        "|---:|---:|---:|",
        *(f"| {w:g} | {score[w]:.3f} | {worst[w]:.2f} |" for w in weights),
        "",
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "routing-tuning.md").write_text("\n".join(lines))
    return {"score": score, "worst": worst, "chosen": chosen, "rows": rows}
