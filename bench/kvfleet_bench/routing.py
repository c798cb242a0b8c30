"""`kvfleet bench routing`: every policy, every workload, at 50/80/95% of the fleet's capacity.

All in the fleet simulator (virtual time), with the gateway's own policy objects. Capacity
is measured by the harness for each workload: the request rate the fleet completes when
offered far more than it can take, routed round robin (no routing intelligence), so the same
offered load is asked of every policy. `bursty` is generated-shared-prefix traffic arriving
in bursts (a fifth of each 10 s period at five times the mean rate).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from statistics import fmean
from typing import Any

from kvfleet_bench.live_routing import live_check, live_report
from kvfleet_bench.routing_cells import Cell, merge_seeds
from kvfleet_bench.routing_decision import PAGE, decision_time
from kvfleet_bench.routing_file import staged_cells
from kvfleet_bench.routing_gateways import gateway_goals, gateways_report, many_gateways
from kvfleet_bench.routing_lora import WORKLOAD as LORA
from kvfleet_bench.routing_lora import lora_cells, lora_goals, lora_report
from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig, derive_layout
from kvfleet_sim.fleet.model import FleetConfig
from kvfleet_sim.fleet.routing import KvfleetTuning, Priors, deployment_priors, routed_fleet
from kvfleet_sim.fleet.traces import RateTrace
from kvfleet_sim.fleet.workload_file import load_workload_file
from kvfleet_sim.fleet.workloads import Workload, WorkloadSpec
from kvfleet_sim.hf_config import load_model_config

WORKLOADS = (
    "generated-shared-prefix", "multi-turn", "sharegpt", "hot-tenant", "bursty", "kv-pressure",
    LORA,
)  # fmt: skip
KV_PRESSURE_PREFIX = 4096
KV_PRESSURE_REPLICAS = 5.0
KV_PRESSURE_OVERLOAD = (1.5, 2.0)
"""kv-pressure is also offered more than round robin can serve: saturation, where a router
shows in throughput, not only in latency."""
"""kv-pressure: distinct 4,096-token system prompts adding up to five replicas' KV cache."""
POLICIES = (
    "random", "round_robin", "least_load", "sglang_cache_aware", "kvfleet", "kvfleet_events",
    "oracle",
)  # fmt: skip
LOADS = (0.5, 0.8, 0.95)
LIVE_REQUESTS, LIVE_RATE = 300, 25.0


def _spec(config: FleetConfig, workload: str, n: int, seed: int) -> WorkloadSpec:
    if workload == "kv-pressure":
        # Where a router earns its keep: the prefixes in use are several times one replica's
        # KV cache (so no replica can hold them all) but fit in the fleet's.
        kv = derive_layout(config.engine).max_total_num_tokens
        groups = min(
            math.ceil(KV_PRESSURE_REPLICAS * kv / KV_PRESSURE_PREFIX),
            int(0.7 * config.replicas * kv / KV_PRESSURE_PREFIX),
        )
        n = max(n, 8 * groups)  # each prefix asked for ~8 times
        return WorkloadSpec(
            "generated-shared-prefix",
            n,
            seed=seed,
            gsp_num_groups=groups,
            gsp_prompts_per_group=math.ceil(n / groups),
            gsp_system_prompt_len=KV_PRESSURE_PREFIX,
            gsp_question_len=128,
            gsp_output_len=128,
        )
    kind = "generated-shared-prefix" if workload == "bursty" else workload
    return WorkloadSpec(kind, n, seed=seed)  # type: ignore[arg-type]


def _trace(workload: str, rate: float) -> RateTrace:
    if workload == "bursty":
        return RateTrace("bursts", rate=rate, burst_period_s=10.0, burst_duty=0.2)
    return RateTrace("poisson", rate=rate)


def _run(
    config: FleetConfig,
    policy: str,
    workload: str,
    rate: float,
    n: int,
    seed: int,
    tuning: KvfleetTuning,
) -> Any:
    spec = _spec(config, workload, n, seed)
    conv_rate = rate / spec.turns if spec.kind == "multi-turn" else rate
    sim = routed_fleet(config, policy, tuning)
    vocab = config.engine.model.vocab_size
    return sim.run(Workload(spec, _trace(workload, conv_rate), vocab)).summary


def capacity(config: FleetConfig, workload: str, n: int, seed: int, tuning: KvfleetTuning) -> float:
    """Requests/s the fleet completes when offered far more than it can take."""
    flood = 1000.0 if workload != "multi-turn" else 4000.0
    s = _run(
        config,
        "round_robin",
        "generated-shared-prefix" if workload == "bursty" else workload,
        flood,
        n,
        seed,
        tuning,
    )
    return float(s.request_throughput)


def run_routing_bench(
    out_dir: Path,
    log: Callable[[str], None],
    *,
    gpu: str = "h100",
    model: str | None = None,
    replicas: int = 8,
    workloads: Sequence[str] = WORKLOADS,
    policies: Sequence[str] = POLICIES,
    loads: Sequence[float] = LOADS,
    num_requests: int = 2000,
    seeds: Sequence[int] = (1, 2, 3),
    live: bool = True,
    model_config: Path | None = None,
    tp: int = 1,
    workload_file: Path | None = None,
    event_pages: int = 500_000,
) -> dict[str, Any]:
    """Every policy on every workload at every load (or, with `workload_file`, at each of the
    file's stages instead of the built-in workloads)."""
    spec = (
        load_model_config(model_config, model)
        if model_config
        else BUILTIN.model(model or "llama-3.1-8b")
    )
    engine = EngineConfig.for_model(spec, BUILTIN.gpu(gpu), tp_size=tp)
    config = FleetConfig(engine, replicas=replicas)
    # What is simulated, named in every line and the report (not the --model default).
    shape = f"{spec.name}/{gpu}" + (f" TP{tp}" if tp > 1 else "")
    # What a gateway runs with no configuration: nothing read from the cost model it is
    # scored on (the defaults describe an 8B model on one H100, whatever is simulated).
    tuning = KvfleetTuning()
    # First, in a fresh process (a gateway's, not one that has run the cells below).
    timing = decision_time(event_pages=event_pages, log=log)
    log(
        f"decision time with 32 replicas: kvfleet p50 {timing['kvfleet_p50_us']:.0f} µs, p99 "
        f"{timing['kvfleet_p99_us']:.0f} µs with 100k approximate entries, p99 "
        f"{timing['kvfleet_events_p99_us']:.0f} µs with the event index (sglang_cache_aware p99 "
        f"{timing['sglang_cache_aware_p99_us']:.0f} µs, round_robin "
        f"{timing['round_robin_p99_us']:.1f} µs)"
    )
    runs: list[Cell] = []
    caps: dict[str, float] = {}
    if workload_file is not None:
        for seed in seeds:
            wf = load_workload_file(workload_file, seed)
            stages = ", ".join(f"{s.rate:g} req/s × {s.duration_s:g} s" for s in wf.arrivals.stages)
            log(f"{wf.name} (seed {seed}): {wf.arrivals.kind} stages {stages} on {replicas}× "
                f"{shape}")  # fmt: skip
            runs += staged_cells(config, wf, policies, tuning, log)
        workloads = ()
    lora_runs: list[Cell] = []
    if LORA in workloads:  # its own policies and goals (routing_lora.py)
        lora_runs, caps[LORA] = lora_cells(config, num_requests, seeds, tuning, log)
    for workload in (w for w in workloads if w != LORA):
        caps[workload] = capacity(config, workload, num_requests, seeds[0], tuning)
        log(f"{workload}: capacity {caps[workload]:.1f} req/s on {replicas}× {shape}")
        for load in (*loads, *KV_PRESSURE_OVERLOAD) if workload == "kv-pressure" else loads:
            for policy in policies:
                if policy == "kvfleet_events":
                    continue  # behind one gateway it decides as kvfleet does: see many_gateways
                per_seed = [
                    Cell.of(workload, load, policy, _run(
                        config, policy, workload, load * caps[workload], num_requests, s, tuning
                    ))
                    for s in seeds
                ]  # fmt: skip
                runs += per_seed
                cell = Cell.merge(per_seed)
                log(
                    f"  {load:.0%} {policy:19s} {cell.output_throughput:8,.0f} tok/s "
                    f"[{cell.output_throughput_min:,.0f}–{cell.output_throughput_max:,.0f}]  "
                    f"TTFT p90 {cell.ttft_p90 * 1000:7.1f} ms p99 {cell.ttft_p99 * 1000:8.1f} ms"
                    f"  hit {cell.cache_hit_rate:.2f}"
                )
    cells = merge_seeds(runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    goals = check_goals(cells, runs) + (lora_goals(lora_runs) if lora_runs else [])
    for what, key in (
        ("decision p99 ≤ 100 µs (32 replicas, 100k entries)", "kvfleet_p99_us"),
        (
            f"decision p99 ≤ 100 µs (32 replicas × {event_pages:,} event pages)",
            "kvfleet_events_p99_us",
        ),
    ):
        goals.append(
            {
                "goal": what,
                "workload": "-",
                "load": 0.0,
                "value": timing[key],
                "met": timing[key] <= 100.0,
            }
        )
    gateway_rows: list[dict[str, Any]] = []
    gateway_rate = 0.0
    if "kv-pressure" in caps:
        gateway_rate = max(loads) * caps["kv-pressure"]
        log(f"many gateways: kv-pressure at {gateway_rate:.1f} req/s")
        gateway_rows = many_gateways(
            config,
            lambda s: _spec(config, "kv-pressure", num_requests, s),
            gateway_rate,
            seeds,
            tuning,
            log,
        )
        goals += gateway_goals(gateway_rows, max(loads))
    plot(cells, out_dir / "routing.png")
    priors = deployment_priors(config.engine, tuning)
    text = report(
        cells, caps, goals, replicas, shape, num_requests, tuning, priors, timing, len(seeds)
    )
    if gateway_rows:
        text += "\n" + gateways_report(gateway_rows, gateway_rate)
    if lora_runs:
        text += "\n" + lora_report(lora_runs, caps[LORA], lora_goals(lora_runs))
    live_results: dict[str, dict[str, float]] = {}
    if live:
        log("live check over real HTTP (4 real-time engines, kvfleet gateway vs sglang-router)")
        work = out_dir / ".routing-live"
        work.mkdir(exist_ok=True)
        live_results = live_check(work, log)
        text += "\n" + live_report(live_results, LIVE_REQUESTS, LIVE_RATE)
        for f in work.iterdir():
            f.unlink()
        work.rmdir()
    (out_dir / "routing.md").write_text(text)
    return {
        "cells": [asdict(c) for c in cells + merge_seeds(lora_runs)],
        "capacity_rps": caps,
        "goals": goals,
        "decision_time_us": timing,
        "many_gateways": gateway_rows,
        "live": live_results,
    }


def check_goals(cells: list[Cell], runs: list[Cell]) -> list[dict[str, Any]]:
    """The goals, cell by cell: what holds and what does not. Policies are compared seed by
    seed (each seed is the same arrivals and prompts for every policy): the value is the mean
    of the per-seed ratios, and a check is met only when it holds on every seed — beyond the
    spread the seeds show, not on the means alone."""
    by = {(c.workload, c.load, c.policy): c for c in cells}
    per_seed: dict[tuple[str, float, str], list[Cell]] = {}
    for r in runs:
        per_seed.setdefault((r.workload, r.load, r.policy), []).append(r)
    out: list[dict[str, Any]] = []

    def check(goal: str, w: str, load: float, value: float, met: bool) -> None:
        out.append({"goal": goal, "workload": w, "load": load, "value": value, "met": met})

    def paired(ours: Cell, ref: Cell) -> list[tuple[Cell, Cell]]:
        a = per_seed[ours.workload, ours.load, ours.policy]
        b = per_seed[ref.workload, ref.load, ref.policy]
        return list(zip(a, b, strict=True))

    def faster(ours: Cell, ref: Cell, factor: float) -> tuple[float, bool]:
        """Throughput at least `factor` × the other's, on every seed."""
        ratios = [o.output_throughput / r.output_throughput for o, r in paired(ours, ref)]
        return fmean(ratios), min(ratios) >= factor

    def sooner(ours: Cell, ref: Cell, factor: float, p: str = "ttft_p99") -> tuple[float, bool]:
        """TTFT (p99 or p90) at least `factor` × lower, on every seed."""
        ratios = [getattr(r, p) / getattr(o, p) for o, r in paired(ours, ref)]
        return fmean(ratios), min(ratios) >= factor

    saturation = {w: max(c.load for c in cells if c.workload == w) for w, _, _ in by}
    for (w, load, p), ours in by.items():
        if p != "kvfleet":
            continue
        ref = by.get((w, load, "sglang_cache_aware"))
        oracle = by.get((w, load, "oracle"))
        # Below capacity every policy's throughput is the offered load: a throughput goal
        # there cannot fail, so throughput is only judged where the fleet is overloaded.
        if load > 1.0:
            if ref is not None:
                check("throughput ≥ sglang_cache_aware", w, load, *faster(ours, ref, 0.99))
            if oracle is not None:
                check("throughput ≥ 0.9× oracle", w, load, *faster(ours, oracle, 0.9))
        if ref is not None:
            check("p99 TTFT ≤ sglang_cache_aware", w, load, *sooner(ours, ref, 1 / 1.01))
            if w in ("hot-tenant", "bursty"):
                check("p99 TTFT 1.3× lower than sglang_cache_aware", w, load,
                      *sooner(ours, ref, 1.3))  # fmt: skip
        rr = by.get((w, load, "round_robin"))
        if w == "kv-pressure" and load == saturation[w] and rr is not None:
            check("throughput ≥ 1.8× round_robin", w, load, *faster(ours, rr, 1.8))
            check("p90 TTFT ≤ 1/10 of round_robin's", w, load, *sooner(ours, rr, 10, "ttft_p90"))
            if ref is not None:
                check("throughput ≥ 1.15× sglang_cache_aware", w, load, *faster(ours, ref, 1.15))
    return out


def plot(cells: list[Cell], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(c.workload for c in cells))
    if not workloads:  # only the LoRA cell ran (`--workloads lora`): its report has no plot
        return
    policies = list(dict.fromkeys(c.policy for c in cells))
    fig, axes = plt.subplots(2, len(workloads), figsize=(4 * len(workloads), 7), squeeze=False)
    for i, w in enumerate(workloads):
        for p in policies:
            pts = sorted(
                (c.load, c.ttft_p99 * 1000, c.output_throughput)
                for c in cells
                if c.workload == w and c.policy == p
            )
            style = {"linewidth": 2.5} if p == "kvfleet" else {"linewidth": 1.2}
            axes[0][i].plot([x[0] for x in pts], [x[1] for x in pts], marker="o", label=p, **style)
            axes[1][i].plot([x[0] for x in pts], [x[2] for x in pts], marker="o", label=p, **style)
        axes[0][i].set_title(w)
        axes[0][i].set_yscale("log")
        axes[0][i].set_ylabel("TTFT p99 (ms, log)")
        axes[1][i].set_ylabel("output tokens/s")
        axes[1][i].set_xlabel("offered load (share of capacity)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Routing policies on 8 simulated replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ms(seconds: float) -> str:
    """A latency in ms; "—" where no request of the cell finished (all refused)."""
    return "—" if math.isnan(seconds) else f"{seconds * 1000:.1f} ms"


def _p99(c: Cell) -> str:
    if math.isnan(c.ttft_p99):
        return "—"
    return f"{_ms(c.ttft_p99)} [{c.ttft_p99_min * 1000:.1f}–{c.ttft_p99_max * 1000:.1f}]"


def report(
    cells: list[Cell],
    caps: dict[str, float],
    goals: list[dict[str, Any]],
    replicas: int,
    shape: str,
    n: int,
    tuning: KvfleetTuning,
    priors: Priors,
    timing: dict[str, Any],
    seeds: int = 1,
) -> str:
    lines = [
        "# Routing policies",
        "",
        f"Produced by `kvfleet bench routing`: {replicas} replicas of {shape} in "
        f"the fleet simulator, {n} requests per cell and seed (kv-pressure: 8 per prefix), "
        f"{seeds} seeds per cell: the mean, [min–max] over seeds. Offered load as a share of "
        "each workload's capacity (measured with round robin under overload; kv-pressure is "
        "also offered 1.5× and 2× that). Goals compare policies seed by seed (the same "
        "arrivals and prompts): the value is the mean ratio, met only if it holds on every "
        "seed.",
        "",
        "kvfleet priors: the gateway's roofline over what a deployment knows (the model's "
        f"config.json, the GPU's datasheet peaks, {priors.basis}, at "
        f"{tuning.peak_efficiency:.0%} of peak), nothing from the cost model, calibrated "
        f"online from there: prefill {priors.prefill_tokens_per_second:,.0f} tok/s, decode "
        f"step {priors.decode_step_base_s * 1000:.1f} ms + "
        f"{priors.kv_read_s_per_token * 1e9:.0f} ns per KV token.",
        "",
    ]
    for w in dict.fromkeys(c.workload for c in cells):
        title = f"{w} (capacity {caps[w]:.1f} req/s)" if w in caps else f"{w} (workload file)"
        lines += [
            f"## {title}",
            "",
            "| load | policy | output tok/s | TTFT p50 | TTFT p90 | TTFT p99 | cache hit |"
            " imbalance | refused |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in cells:
            if c.workload == w:
                name = f"**{c.policy}**" if c.policy == "kvfleet" else c.policy
                load = f"{c.load:.0%}" if w in caps else f"{c.load:g} req/s"
                lines.append(
                    f"| {load} | {name} | {c.output_throughput:,.0f} "
                    f"[{c.output_throughput_min:,.0f}–{c.output_throughput_max:,.0f}] | "
                    f"{_ms(c.ttft_p50)} | {_ms(c.ttft_p90)} | {_p99(c)} | "
                    f"{c.cache_hit_rate:.2f} | {c.imbalance:.2f} | {c.refused} |"
                )
        lines.append("")
    lines += [
        "## Decision time",
        "",
        "32 replicas, 2,176-token prompts (same run); kvfleet with an approximate prefix index"
        " of 100,000 blocks, kvfleet_events with an exact KV-event index of "
        f"{timing['event_pages_per_replica']:,} pages ({PAGE} tokens each) per replica:",
        "",
        "| policy | p50 | p99 |",
        "|---|---:|---:|",
    ]
    for name in ("round_robin", "sglang_cache_aware", "kvfleet", "kvfleet_events"):
        lines.append(
            f"| {name} | {timing[name + '_p50_us']:.1f} µs | {timing[name + '_p99_us']:.1f} µs |"
        )
    lines += [
        "",
        f"Event index memory: {timing['event_index_mib']:,.0f} MiB for "
        f"{timing['event_distinct_pages']:,} distinct pages, "
        f"{timing['event_index_bytes_per_page']:.0f} bytes per page, "
        f"{timing['event_index_mib_per_replica']:,.0f} MiB per replica of "
        f"{timing['event_pages_per_replica']:,} pages (resident set growth; pages shared by "
        f"replicas cost once). Forgetting one replica (a dropped stream) scans the index: "
        f"{timing['event_index_clear_s'] * 1000:,.0f} ms. Hashing a 2,176-token prompt's pages: "
        f"{timing['page_hash_p50_us']:.0f} µs (p50), before the decision.",
        "",
    ]
    met = sum(g["met"] for g in goals)
    lines += [
        "## Goals",
        "",
        f"{met} of {len(goals)} checks met. Throughput goals are judged only beyond capacity "
        "(below it every policy's throughput is the offered load); the event index only behind "
        "2+ gateways (behind one it decides as the approximate index does, on every workload "
        "here).",
        "",
        "| goal | workload | load | ratio | met |",
        "|---|---|---:|---:|:---:|",
    ]
    for g in goals:
        load = f"{g['load']:.0%}" if g["load"] else "-"
        lines.append(
            f"| {g['goal']} | {g['workload']} | {load} | {g['value']:.2f} | "
            f"{'yes' if g['met'] else '**no**'} |"
        )
    lines += ["", "![routing](routing.png)", ""]
    return "\n".join(lines)


def cells_json(result: dict[str, Any]) -> str:
    keys = (
        "workload",
        "load",
        "policy",
        "output_throughput",
        "ttft_p50",
        "ttft_p90",
        "ttft_p99",
        "cache_hit_rate",
        "imbalance",
    )
    return json.dumps({"cells": [{k: c[k] for k in keys} for c in result["cells"]]})
