"""The LoRA cell of `kvfleet bench routing`: 100 adapters with Zipf popularity on 8 replicas, each
engine running at most 8 adapters per batch (SGLang's `--max-loras-per-batch 8`).

kvfleet routes as the gateway does with `lora:` configured (the product's `affinity`: replicas
holding the adapter, others with an empty queue when every holder has requests waiting; loads on
demand, least recently used idle adapter out). The baselines are routers that do not know
adapters — round robin, random, least loaded: the replica they pick loads what it lacks all the
same — and one that does: the Gateway API Inference Extension's adapter-affinity decision tree
at its published defaults (`gie_lora`, `gie_lora.py`). Capacity is measured round robin at a
flood, as for every workload; `saturation` offers three times that, `0.8` four fifths of it.
Goals, on every seed: at saturation kvfleet completes ≥ 1.5× random's output; at 0.8 its TTFT
p99 is lower than each baseline's. The report also gives kvfleet's output at saturation over
each baseline's (worst seed), the GIE's included.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any

from kvfleet_bench.gie_lora import GieLoraFilter
from kvfleet_bench.routing_cells import Cell, merge_seeds
from kvfleet_sim.fleet.lora_fleet import FleetAdapters
from kvfleet_sim.fleet.model import FleetConfig
from kvfleet_sim.fleet.routing import KvfleetTuning, routed_fleet
from kvfleet_sim.fleet.traces import RateTrace
from kvfleet_sim.fleet.workloads import Workload, WorkloadSpec
from kvfleet_sim.lora import load_seconds

WORKLOAD = "lora"
ADAPTERS, PER_BATCH = 100, 8
POLICIES = ("kvfleet", "round_robin", "random", "least_load", "gie_lora")
GIE = "gie_lora"
"""The GIE's tree filters the replicas; its picker is random among those left."""
SATURATION, MODERATE = 3.0, 0.8
THROUGHPUT_GOAL = 1.5


def lora_config(config: FleetConfig) -> FleetConfig:
    engine = dataclasses.replace(config.engine, max_loras_per_batch=PER_BATCH)
    return dataclasses.replace(config, engine=engine)


def _run(config: FleetConfig, policy: str, rate: float, n: int, seed: int,
         tuning: KvfleetTuning) -> Any:  # fmt: skip
    sim = routed_fleet(config, "random" if policy == GIE else policy, tuning)
    adapters = FleetAdapters(
        aware=policy == "kvfleet",
        max_per_replica=PER_BATCH,  # the operator's maxAdaptersPerReplica: maxLorasPerBatch
        load_s=load_seconds(config.engine.model, config.engine.lora_rank),
    )
    if policy == GIE:
        adapters.chooser = GieLoraFilter(
            adapters.in_use_on, max_active=PER_BATCH, rng=random.Random(seed)
        )
    sim.adapters = adapters
    spec = WorkloadSpec("random", n, seed=seed, input_len=1024, output_len=256,
                        range_ratio=0.5, lora_adapters=ADAPTERS)  # fmt: skip
    vocab = config.engine.model.vocab_size
    return sim.run(Workload(spec, RateTrace("poisson", rate=rate), vocab)).summary


def lora_cells(
    base: FleetConfig,
    n: int,
    seeds: Sequence[int],
    tuning: KvfleetTuning,
    log: Callable[[str], None],
) -> tuple[list[Cell], float]:
    """Every policy at saturation and at 0.8 of capacity, per seed; and the capacity."""
    config = lora_config(base)
    capacity = float(_run(config, "round_robin", 1000.0, n, seeds[0], tuning).request_throughput)
    log(f"{WORKLOAD}: capacity {capacity:.1f} req/s ({ADAPTERS} adapters, {PER_BATCH} per batch)")
    runs: list[Cell] = []
    for load in (MODERATE, SATURATION):
        for policy in POLICIES:
            per_seed = [
                Cell.of(WORKLOAD, load, policy, _run(config, policy, load * capacity, n, s, tuning))
                for s in seeds
            ]
            runs += per_seed
            cell = Cell.merge(per_seed)
            log(f"  {load:g}× {policy:12s} {cell.output_throughput:8,.0f} tok/s "
                f"[{cell.output_throughput_min:,.0f}–{cell.output_throughput_max:,.0f}]  TTFT p99 "
                f"{cell.ttft_p99 * 1000:8.1f} ms [{cell.ttft_p99_min * 1000:,.0f}–"
                f"{cell.ttft_p99_max * 1000:,.0f}]")  # fmt: skip
    return runs, capacity


def lora_goals(runs: list[Cell]) -> list[dict[str, Any]]:
    """The two goals, each checked seed by seed (a seed is the same arrivals for every
    policy): the value is the worst seed's ratio."""
    by: dict[tuple[float, str], list[Cell]] = {}
    for r in runs:
        by.setdefault((r.load, r.policy), []).append(r)
    ours = by[SATURATION, "kvfleet"]
    ratios = [o.output_throughput / r.output_throughput
              for o, r in zip(ours, by[SATURATION, "random"], strict=True)]  # fmt: skip
    goals = [{
        "goal": f"lora: output at saturation ≥ {THROUGHPUT_GOAL}× random's (worst seed)",
        "workload": WORKLOAD, "load": SATURATION, "value": min(ratios),
        "met": min(ratios) >= THROUGHPUT_GOAL,
    }]  # fmt: skip
    for base in POLICIES[1:]:
        pairs = zip(by[MODERATE, "kvfleet"], by[MODERATE, base], strict=True)
        worst = max(o.ttft_p99 / r.ttft_p99 for o, r in pairs)
        goals.append({
            "goal": f"lora: TTFT p99 at {MODERATE:g} below {base}'s (kvfleet/{base}, worst seed)",
            "workload": WORKLOAD, "load": MODERATE, "value": worst, "met": worst < 1.0,
        })  # fmt: skip
    return goals


def saturation_ratios(runs: list[Cell]) -> dict[str, float]:
    """Baseline → kvfleet's output at saturation over its, on the worst seed."""
    by: dict[str, list[Cell]] = {}
    for r in runs:
        if r.load == SATURATION:
            by.setdefault(r.policy, []).append(r)
    return {base: min(o.output_throughput / b.output_throughput
                      for o, b in zip(by["kvfleet"], by[base], strict=True))
            for base in POLICIES[1:]}  # fmt: skip


def lora_report(runs: list[Cell], capacity: float, goals: list[dict[str, Any]]) -> str:
    lines = [
        f"## LoRA adapters: {ADAPTERS} adapters (Zipf), {PER_BATCH} per batch",
        "",
        "Requests of 512–1,024 prompt and 128–256 output tokens, each with one of "
        f"{ADAPTERS} adapters (popularity 1/k). Capacity {capacity:.1f} req/s (round robin at "
        "a flood). kvfleet routes by adapter affinity as the gateway does; the others do not "
        "know adapters (the replica they pick loads what it lacks). Mean over seeds, "
        "[worst–best].",
        "",
        "| load | policy | output tok/s | TTFT p99 ms |",
        "|---|---|---|---|",
    ]
    for c in merge_seeds(runs):
        lines.append(
            f"| {'saturation (3×)' if c.load == SATURATION else f'{c.load:g}'} | {c.policy} | "
            f"{c.output_throughput:,.0f} [{c.output_throughput_min:,.0f}–"
            f"{c.output_throughput_max:,.0f}] | {c.ttft_p99 * 1000:,.0f} "
            f"[{c.ttft_p99_min * 1000:,.0f}–{c.ttft_p99_max * 1000:,.0f}] |"
        )
    lines += [
        "",
        "kvfleet's output at saturation over each baseline's, worst seed: "
        + ", ".join(f"{base} {ratio:.2f}×" for base, ratio in saturation_ratios(runs).items())
        + ".",
    ]
    lines += ["", "| goal | value | met |", "|---|---|---|"]
    lines += [f"| {g['goal']} | {g['value']:.2f} | {'yes' if g['met'] else 'NO'} |" for g in goals]
    return "\n".join(lines) + "\n"
