"""`kvfleet bench ...`: benchmarks that print numbers, ratios and write reports."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import click

from kvfleet_bench.autoscale import POLICIES as AUTOSCALE_POLICIES
from kvfleet_bench.autoscale import TRACES as AUTOSCALE_TRACES
from kvfleet_bench.autoscale import Plan as AutoscalePlan
from kvfleet_bench.autoscale import cells_json as autoscale_json
from kvfleet_bench.autoscale import run_autoscale_bench
from kvfleet_bench.fairness import dump_json as fairness_json
from kvfleet_bench.fairness import run_fairness_bench
from kvfleet_bench.fairness_report import write_report as write_fairness_report
from kvfleet_bench.fidelity import run_sim_bench
from kvfleet_bench.gateway import run_gateway_bench
from kvfleet_bench.hostile_fields import as_json as fields_json
from kvfleet_bench.hostile_fields import report as fields_report
from kvfleet_bench.hostile_fields import run_hostile_fields
from kvfleet_bench.pd import WORKLOADS as PD_WORKLOADS
from kvfleet_bench.pd import dump_json as pd_json
from kvfleet_bench.pd import run_pd_bench
from kvfleet_bench.pd_live import live_check
from kvfleet_bench.pd_report import write_report as write_pd_report
from kvfleet_bench.routing import LOADS, POLICIES, WORKLOADS, cells_json, run_routing_bench
from kvfleet_bench.spec_cost import run_spec_bench
from kvfleet_sim.fleet.tracefile import TraceFileError, read_trace

RESULTS = Path("bench/results")


@click.group("bench")
def bench() -> None:
    """Benchmarks; reports land in bench/results/ (markdown + PNG)."""


@bench.command("sim")
@click.option(
    "--des-requests",
    type=int,
    default=50_000,
    show_default=True,
    help="Requests for the fleet-DES speed run.",
)
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), default=RESULTS, show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
def sim_bench(des_requests: int, out_dir: Path, as_json: bool) -> None:
    """Simulator fidelity vs published GPU numbers, DES speed, streaming-server CPU."""
    result = run_sim_bench(out_dir, des_requests, lambda m: click.echo(m, err=as_json))
    click.echo(
        f"wrote {out_dir / 'sim-fidelity.md'} and {out_dir / 'sim-fidelity.png'}", err=as_json
    )
    if as_json:
        click.echo(json.dumps(result, default=str))


@bench.command("gateway")
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), default=RESULTS, show_default=True
)
@click.option(
    "--seconds", type=float, default=5.0, show_default=True, help="Duration of each throughput run."
)
@click.option(
    "--litellm",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="LiteLLM's `litellm` command, to measure its proxy too (make bench builds "
    ".venv-litellm/bin/litellm); without it LiteLLM is left out of the report.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
def gateway_bench(out_dir: Path, seconds: float, litellm: Path | None, as_json: bool) -> None:
    """Gateway overhead vs direct calls; throughput and CPU per request vs sglang-router
    and LiteLLM."""
    result = run_gateway_bench(out_dir, lambda m: click.echo(m, err=as_json), seconds, litellm)
    met = sum(g["met"] for g in result["goals"])
    click.echo(
        f"goals met: {met} of {len(result['goals'])}; wrote {out_dir / 'gateway.md'} and "
        f"{out_dir / 'gateway.png'}",
        err=as_json,
    )
    if as_json:
        keys = ("path", "mode", "rps", "cpu_ms_per_request", "added_ttft_p50_ms", "streams")
        click.echo(json.dumps({"rows": [{k: r[k] for k in keys} for r in result["rows"]]}))


@bench.command("reliability")
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), default=RESULTS, show_default=True
)
@click.option("--requests", type=int, default=1000, show_default=True)
@click.option("--seeds", type=int, default=3, show_default=True)
def reliability_bench(out_dir: Path, requests: int, seeds: int) -> None:
    """Adversarial requests over 3 gateways sharing Redis, with a Redis restart (needs
    redis-server)."""
    import tempfile

    from kvfleet_bench.reliability import run_reliability_bench

    with tempfile.TemporaryDirectory(prefix="kvfleet-reliability-") as work:
        runs = run_reliability_bench(out_dir, Path(work), seeds, requests)
    for r in runs:
        click.echo(
            f"seed {r.seed}: billed {r.billed:,} of {r.budget:,} (engines counted "
            f"{r.engine_tokens:,}); leases left {r.leases_left}, reserved left "
            f"{r.reserved_left}; 5xx (not 503) {r.server_errors}; last refusal "
            f"{r.last_refusal_after_restart_s:.1f}s after Redis was back"
        )
    click.echo(f"wrote {out_dir / 'reliability.md'} (with the hostile fields and specs)")


@bench.command("cluster")
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), default=RESULTS, show_default=True
)
@click.option("--services", type=int, default=1000, show_default=True)
@click.option("--runs", type=int, default=3, show_default=True, help="API throughput runs.")
@click.option("--seconds", type=float, default=4.0, show_default=True, help="Per throughput run.")
@click.option(
    "--steady", type=float, default=60.0, show_default=True, help="Steady-state window (s)."
)
def cluster_bench(out_dir: Path, services: int, runs: int, seconds: float, steady: float) -> None:
    """The local API server's throughput vs a bare HTTP server, 1,000 InferenceServices
    reconciled by the operator (time to Ready, request rate, steady-state cost), and 100
    resynced every second for the steady window (writes and Events: the goal is none)."""
    from kvfleet_bench.cluster_scale import run_cluster_bench

    _, scale, resync = run_cluster_bench(out_dir, services, runs, seconds, steady, click.echo)
    click.echo(
        f"steady state: {scale.steady_operator_requests} operator requests in "
        f"{scale.steady_window_s:.0f}s = {scale.per_service_hour:.2f} per service per hour"
    )
    click.echo(
        f"{resync.services} services x {resync.resyncs:.0f} resyncs: "
        f"{resync.steady_operator_writes} writes, {resync.steady_events} Events"
    )
    click.echo(f"wrote {out_dir / 'cluster.md'}")


def _seeds(value: str) -> list[int]:
    """`--seeds 1,2,3`, or a clear usage error."""
    try:
        seeds = [int(x) for x in _csv(value)]
    except ValueError as exc:
        raise click.UsageError(f"--seeds: {exc}") from exc
    if not seeds:
        raise click.UsageError("--seeds: at least one, e.g. 1,2,3")
    return seeds


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


@bench.command("routing")
@click.option("--gpu", default="h100", show_default=True)
@click.option(
    "--model",
    default=None,
    help="Catalogue name (default llama-3.1-8b); with --model-config, the name reports use"
    " (default: the config's directory).",
)
@click.option(
    "--model-config",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="Any model from its Hugging Face config.json (or directory).",
)
@click.option("--tp", type=int, default=1, show_default=True, help="GPUs per replica.")
@click.option(
    "--workload-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="inference-perf's config (data + load stages) replayed instead of the built-in"
    " workloads; each stage is a cell.",
)
@click.option("--replicas", type=int, default=8, show_default=True)
@click.option("--workloads", default=",".join(WORKLOADS), show_default=True)
@click.option("--policies", default=",".join(POLICIES), show_default=True)
@click.option("--loads", default=",".join(str(x) for x in LOADS), show_default=True)
@click.option("--num-requests", type=int, default=2000, show_default=True)
@click.option("--seeds", default="1,2,3", show_default=True, help="Every cell runs once per seed.")
@click.option(
    "--live/--no-live",
    default=True,
    show_default=True,
    help="Also replay a workload over real HTTP: kvfleet gateway vs sglang-router.",
)
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), default=RESULTS, show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
def routing_bench(
    gpu: str,
    model: str | None,
    model_config: Path | None,
    tp: int,
    workload_file: Path | None,
    replicas: int,
    workloads: str,
    policies: str,
    loads: str,
    num_requests: int,
    seeds: str,
    live: bool,
    out_dir: Path,
    as_json: bool,
) -> None:
    """Routing policies in the fleet simulator: throughput, TTFT, cache hits, balance."""
    unknown = set(_csv(workloads)) - set(WORKLOADS) | set(_csv(policies)) - set(POLICIES)
    if unknown:
        raise click.UsageError(f"unknown workload(s) or policy(ies): {', '.join(sorted(unknown))}")
    try:
        load_values = [float(x) for x in _csv(loads)]
    except ValueError as exc:
        raise click.UsageError(f"--loads: {exc}") from exc
    if not load_values or any(not 0 < x <= 2 for x in load_values):
        raise click.UsageError("--loads: shares of capacity in (0, 2], e.g. 0.5,0.8,0.95")
    seed_values = _seeds(seeds)
    from kvfleet_sim.catalog import CatalogError
    from kvfleet_sim.config import ConfigError
    from kvfleet_sim.fleet.workload_file import WorkloadFileError

    try:
        result = run_routing_bench(
            out_dir,
            lambda m: click.echo(m, err=as_json),
            gpu=gpu,
            model=model,
            replicas=replicas,
            workloads=_csv(workloads),
            policies=_csv(policies),
            loads=load_values,
            num_requests=num_requests,
            seeds=seed_values,
            live=live,
            model_config=model_config,
            tp=tp,
            workload_file=workload_file,
        )
    except (CatalogError, ConfigError, WorkloadFileError) as exc:  # what was asked for
        raise click.UsageError(str(exc)) from exc
    met = sum(g["met"] for g in result["goals"])
    click.echo(
        f"goals met: {met} of {len(result['goals'])}; wrote {out_dir / 'routing.md'}", err=as_json
    )
    if as_json:
        click.echo(cells_json(result))


@bench.command("cut-trace")
@click.argument("source", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--start-s", type=float, default=0.0, show_default=True,
              help="Window start, seconds after the file's first request.")  # fmt: skip
@click.option("--duration-s", type=float, default=900.0, show_default=True)
def cut_trace_command(source: Path, out: Path, start_s: float, duration_s: float) -> None:
    """Cut a window of a full public trace (Azure LLM inference CSV or Mooncake JSONL),
    its lines verbatim: how the bench's trace samples were made."""
    from kvfleet_bench.trace_cut import cut_trace

    try:
        n = cut_trace(source, out, start_s, duration_s)
    except TraceFileError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(f"wrote {n} requests to {out}")


@bench.command("routing-tuning")
@click.option("--num-requests", type=int, default=1000, show_default=True)
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), default=RESULTS, show_default=True
)
def routing_tuning_bench(num_requests: int, out_dir: Path) -> None:
    """The kvfleet policy's missWeight swept on workloads the routing report does not show."""
    from kvfleet_bench.routing_tuning import sweep_miss_weight

    result = sweep_miss_weight(out_dir, click.echo, num_requests=num_requests)
    click.echo(f"best missWeight {result['chosen']:g}; wrote {out_dir / 'routing-tuning.md'}")


@bench.command("autoscale")
@click.option("--traces", default=",".join(AUTOSCALE_TRACES), show_default=True)
@click.option("--policies", default=",".join(AUTOSCALE_POLICIES), show_default=True,
              help="kvfleet always runs; hpa and keda are swept, the oracle searched.")  # fmt: skip
@click.option("--seeds", default="1,2,3", show_default=True)
@click.option(
    "--trace-file",
    "trace_files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Also replay this trace (repeatable): an Azure LLM inference CSV "
    "(TIMESTAMP,ContextTokens,GeneratedTokens) or a Mooncake trace (*.jsonl: timestamp ms, "
    "input_length, output_length, hash_ids).",
)
@click.option(
    "--time-scale", type=float, default=1.0, show_default=True, help="Trace file: compress time."
)
@click.option(
    "--rate-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Trace file: multiply requests.",
)
@click.option("--workers", type=int, default=2, show_default=True, help="Cells run in parallel.")
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), default=RESULTS, show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
def autoscale_bench(
    traces: str,
    policies: str,
    seeds: str,
    trace_files: tuple[Path, ...],
    time_scale: float,
    rate_scale: float,
    workers: int,
    out_dir: Path,
    as_json: bool,
) -> None:
    """Autoscaling: kvfleet vs KEDA and HPA tuned at their best and a hindsight oracle."""
    unknown = set(_csv(traces)) - set(AUTOSCALE_TRACES) | set(_csv(policies)) - set(
        AUTOSCALE_POLICIES
    )
    if unknown:
        raise click.UsageError(f"unknown trace(s) or policy(ies): {', '.join(sorted(unknown))}")
    if time_scale <= 0 or rate_scale <= 0 or workers < 1:
        raise click.UsageError("--time-scale and --rate-scale must be > 0, --workers >= 1")
    try:
        seed_values = [int(x) for x in _csv(seeds)]
        for f in trace_files:
            read_trace(f)  # a bad file fails here, with its line, before any run
    except (ValueError, TraceFileError) as exc:
        raise click.UsageError(str(exc)) from exc
    if not seed_values:
        raise click.UsageError("--seeds: at least one")
    plan = AutoscalePlan(_csv(traces), seed_values, trace_files, time_scale, rate_scale,
                         _csv(policies))  # fmt: skip
    result = run_autoscale_bench(out_dir, lambda m: click.echo(m, err=as_json), plan, workers)
    met = sum(g["met"] for g in result["goals"])
    click.echo(
        f"goals met: {met} of {len(result['goals'])}; wrote {out_dir / 'autoscale.md'}",
        err=as_json,
    )
    if as_json:
        click.echo(autoscale_json(result))


@bench.command("pd")
@click.option("--seeds", default="1,2,3", show_default=True)
@click.option("--workloads", default=",".join(w.name for w in PD_WORKLOADS), show_default=True)
@click.option("--workers", type=int, default=2, show_default=True, help="Cells run in parallel.")
@click.option("--live/--no-live", default=True, show_default=True,
              help="Also time kvfleet's gateway against sglang-router in PD mode.")  # fmt: skip
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), default=RESULTS, show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
def pd_bench(seeds: str, workloads: str, workers: int, live: bool, out_dir: Path,
             as_json: bool) -> None:  # fmt: skip
    """Prefill/decode disaggregation vs colocated serving: goodput at equal GPU count."""
    by_name = {w.name: w for w in PD_WORKLOADS}
    unknown = set(_csv(workloads)) - set(by_name)
    if unknown:
        raise click.UsageError(f"unknown workload(s): {', '.join(sorted(unknown))}")
    seed_values = _seeds(seeds)
    if workers < 1:
        raise click.UsageError("--workers >= 1")

    def say(message: str) -> None:
        click.echo(message, err=as_json)

    cells = run_pd_bench(say, workloads=[by_name[w] for w in _csv(workloads)],
                         seeds=seed_values, workers=workers)  # fmt: skip
    checks_live = []
    if live:
        for seed in seed_values:
            result = {**live_check(seed), "seed": seed}
            ours, theirs = result["kvfleet"]["ttft_p99"], result["sglang-router"]["ttft_p99"]
            say(f"live (seed {seed}): kvfleet TTFT p99 {ours * 1000:.0f} ms, sglang-router "
                f"{theirs * 1000:.0f} ms")  # fmt: skip
            checks_live.append(result)
    checks = write_pd_report(out_dir, cells, checks_live)
    for g in checks:
        say(f"{'met' if g['met'] else 'MISSED'}: {g['goal']}: {g['detail']}")
    say(f"goals met: {sum(g['met'] for g in checks)} of {len(checks)}; wrote {out_dir / 'pd.md'}")
    if as_json:
        click.echo(pd_json(cells))


@bench.command("fairness")
@click.option("--seeds", default="1,2,3", show_default=True)
@click.option("--workers", type=int, default=2, show_default=True, help="Seeds run in parallel.")
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), default=RESULTS, show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
def fairness_bench(seeds: str, workers: int, out_dir: Path, as_json: bool) -> None:
    """Fair sharing under overload: a flooding tenant beside two steady ones, FIFO vs fair."""
    seed_values = _seeds(seeds)
    if workers < 1:
        raise click.UsageError("--workers >= 1")

    def say(message: str) -> None:
        click.echo(message, err=as_json)

    runs = run_fairness_bench(say, seed_values, workers)
    checks = write_fairness_report(out_dir, runs)
    for g in checks:
        say(f"{'met' if g['met'] else 'MISSED'}: {g['goal']}: {g['detail']}")
    say(f"goals met: {sum(g['met'] for g in checks)} of {len(checks)}; wrote "
        f"{out_dir / 'fairness.md'}")  # fmt: skip
    if as_json:
        click.echo(fairness_json(runs))


@bench.command("spec")
@click.option("--runs", type=int, default=5, show_default=True, help="Parses per spec (median).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
def spec_bench(runs: int, as_json: bool) -> None:
    """CPU time of the operator's parse of an InferenceService at the CRD's largest sizes."""
    result = run_spec_bench(lambda m: click.echo(m, err=as_json), max(runs, 1))
    if as_json:
        click.echo(json.dumps(result))


@bench.command("hostile-fields")
@click.option("--out", "out_file", type=click.Path(path_type=Path), default=None,
              help="Also write the report's section here (`kvfleet bench reliability` writes "
                   "it into reliability.md).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
def hostile_fields_bench(out_file: Path | None, as_json: bool) -> None:
    """Issue 55's hostile request fields and specs, each fired once, with what it measures
    (the last section of `kvfleet bench reliability`'s report, on its own)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvfleet-fields-") as work:
        vectors = run_hostile_fields(Path(work), lambda m: click.echo(m, err=as_json))
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(fields_report(vectors, time.perf_counter() - started))
        click.echo(f"wrote {out_file}", err=as_json)
    if as_json:
        click.echo(json.dumps(fields_json(vectors)))
