"""`kvfleet demo`: the most complete stack this machine can show, with no GPU and no cluster.

By default the live stack (`demo_stack`): simulator engine processes behind the real gateway,
two tenants' traffic through it. `--simulated-fleet` shows the fleet simulator instead: 4
replicas under a traffic spike, 4× faster than real time.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
from rich.console import Group
from rich.panel import Panel
from rich.table import Table

from kvfleet_bench.demo.live import WINDOW_S, live_view
from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig
from kvfleet_sim.fleet.collector import NoRequestFinished, percentile
from kvfleet_sim.fleet.des import FleetSimulator
from kvfleet_sim.fleet.model import FleetConfig, Progress
from kvfleet_sim.fleet.routing import fleet_policy
from kvfleet_sim.fleet.traces import RateTrace
from kvfleet_sim.fleet.workloads import Workload, WorkloadSpec


def _render(p: Progress, sim_total: float, model: str, gpu: str) -> Group:
    recent = [r for r in p.records if r.finish >= p.now - WINDOW_S]
    ttft = [r.ttft for r in recent]
    tokens = sum(r.output_tokens for r in recent)
    prompt = sum(r.prompt_tokens for r in recent)
    hit = sum(r.cached_tokens for r in recent) / prompt if prompt else 0.0
    fleet = Table(
        title=f"fleet: {len(p.replicas)}× {model} on {gpu}  ·  t = {p.now:5.1f} s "
        f"of {sim_total:.0f} s (simulated)",
        expand=True,
    )
    last = f"(last {WINDOW_S:.0f} s)"
    for col in ("finished", f"req/s {last}", "output tok/s", f"TTFT p50 {last}",
                f"TTFT p99 {last}", "cache hits"):  # fmt: skip
        fleet.add_column(col, justify="right")
    fleet.add_row(
        f"{p.finished:,}",
        f"{len(recent) / WINDOW_S:.1f}",
        f"{tokens / WINDOW_S:,.0f}",
        f"{percentile(ttft, 50) * 1000:,.0f} ms" if ttft else "—",
        f"{percentile(ttft, 99) * 1000:,.0f} ms" if ttft else "—",
        f"{hit:.0%}",
    )
    reps = Table(title="replicas (live engine metrics, as /metrics would report)", expand=True)
    for col in ("replica", "running", "queued", "KV used", "last prefill hit", "gen tok/s", "busy"):
        reps.add_column(col, justify="right")
    for r in p.replicas:
        load = r.engine.load()
        reps.add_row(
            f"replica-{r.index}",
            str(load.num_running_reqs),
            str(load.num_waiting_reqs),
            f"{load.token_usage:.0%}",
            f"{load.cache_hit_rate:.0%}",
            f"{load.gen_throughput:,.0f}",
            f"{r.busy_s / max(p.now, 1e-9):.0%}",
        )
    return Group(Panel(fleet), reps)


def run_demo(
    duration: float, replicas: int = 4, model: str = "llama-3.1-8b", gpu: str = "h100"
) -> dict[str, Any]:
    speed = 4.0  # simulated seconds per wall second
    sim_total = duration * speed
    config = FleetConfig(
        EngineConfig(model=BUILTIN.model(model), gpu=BUILTIN.gpu(gpu)), replicas=replicas
    )
    trace = RateTrace(
        "step",
        rate=8.0 * replicas,
        peak_rate=20.0 * replicas,
        start_s=sim_total * 0.4,
        duration_s=sim_total * 0.25,
    )
    expected = int(sim_total * trace.rate + trace.duration_s * (trace.peak_rate - trace.rate))
    workload = Workload(
        WorkloadSpec(
            "generated-shared-prefix",
            num_requests=max(1, expected),
            gsp_num_groups=16,
            gsp_output_len=128,
        ),
        trace,
        config.engine.model.vocab_size,
    )
    wall0 = time.monotonic()
    with live_view() as live:

        def show(p: Progress) -> None:
            live.update(_render(p, sim_total, model, gpu))
            ahead = p.now / speed - (time.monotonic() - wall0)
            if ahead > 0:
                time.sleep(ahead)  # pace the simulation so people can watch it

        try:
            result = FleetSimulator(config, fleet_policy("kvfleet")).run(
                workload, on_progress=show, progress_interval_s=0.5, time_limit_s=sim_total
            )
        except NoRequestFinished:
            result = None
    if result is None:
        # A request takes over a simulated second (its prefill, then 128 tokens): a run
        # shorter than that ends before any does, and has no TTFT or throughput to show.
        raise click.ClickException(
            f"no request finished in the {sim_total:.1f} s simulated (--duration {duration:g}"
            f" at {speed:g}x real time): give a longer --duration (1 or more)"
        )
    s = result.summary
    click.echo(
        f"\nthe whole run: {s.requests:,} requests · {s.output_throughput:,.0f} output tok/s · "
        f"TTFT p50 "
        f"{s.ttft_p50 * 1000:.0f} ms, p99 {s.ttft_p99 * 1000:.0f} ms · cache hits "
        f"{s.cache_hit_rate:.0%} · {s.gpu_seconds_per_request:.2f} GPU-s/request"
    )
    return s.as_dict()


@click.command("demo")
@click.option(
    "--duration",
    type=float,
    default=None,
    help="Seconds of traffic (default: 120 for the autoscaler, 20 for the others).",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path, file_okay=False, resolve_path=True),
    default=Path("kvfleet-demo"),
    show_default=True,
    help="Where the summary, the timeline PNG and the cluster's kubeconfig go.",
)
@click.option("--quick", is_flag=True, help="A shortened run (30 s of traffic) that still checks.")
@click.option(
    "--stack",
    "no_cluster",
    is_flag=True,
    help="The stack without Kubernetes: engines and the gateway as plain processes.",
)
@click.option(
    "--simulated-fleet",
    is_flag=True,
    help="Show the fleet simulator (virtual time) instead of the live stack.",
)
@click.option(
    "--replicas", type=int, default=4, show_default=True, help="Replicas of the simulated fleet."
)
def demo(
    duration: float | None,
    out: Path,
    quick: bool,
    no_cluster: bool,
    simulated_fleet: bool,
    replicas: int,
) -> None:
    """The autoscaler at work on the local cluster (the real Kubernetes control plane, built
    from its Go modules once): the real operator, a warm pool, three tenants' bursty traffic;
    a live view, then a summary and a PNG timeline in --out.

    Exits 1, saying what failed, unless requests were served, a warm replica was promoted,
    the fleet scaled up and back down, and the token budget held."""
    if (duration is not None and duration <= 0) or replicas < 1:
        raise click.UsageError("--duration must be > 0 and --replicas >= 1")
    if no_cluster and simulated_fleet:
        raise click.UsageError("choose one of --stack and --simulated-fleet")
    if simulated_fleet:
        run_demo(duration or 20.0, replicas)
        return
    import tempfile

    if no_cluster:
        from kvfleet_bench.demo.stack import run_stack_demo

        with tempfile.TemporaryDirectory(prefix="kvfleet-demo-") as work:
            summary = run_stack_demo(duration or 20.0, Path(work))
        click.echo(f"\nthe whole run (the live view's TTFT: its last {WINDOW_S:.0f} s):")
        for name, s in summary.items():
            refused = ", ".join(f"{k} {v}" for k, v in s["refused"].items()) or "none"
            click.echo(
                f"{name}: {s['ok']}/{s['sent']} served, refused: {refused}; TTFT p50 "
                f"{s['ttft_p50_ms']:.0f} ms, p99 {s['ttft_p99_ms']:.0f} ms; cache hits "
                f"{s['cache_hit_rate']:.0%}"
            )
        return
    from kvfleet_bench.demo.autoscaler import DemoConfig, quick_config, run_autoscaler_demo

    config = quick_config(out) if quick else DemoConfig(out=out)
    if duration is not None:
        config = replace(config, duration_s=duration)
    click.echo(
        f"kvfleet demo: the local cluster, the operator and an autoscaled service; "
        f"kubectl --kubeconfig {out / 'kubeconfig'} get pods -n ai (while it runs)",
        err=True,
    )
    from kvfleet_bench.demo.autoscaler import SignalsUnavailable

    try:
        doc = run_autoscaler_demo(config)
    except SignalsUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"\nthe whole run (the live view's TTFT: its last {WINDOW_S:.0f} s):")
    for name, t in doc["tenants"].items():
        refused = ", ".join(f"{k} {v}" for k, v in t["refused"].items()) or "none"
        click.echo(
            f"{name:13} {t['ok']}/{t['sent']} served, 429: {refused}; TTFT p50 "
            f"{t['ttft_p50_ms'] or 0:,} ms, p99 {t['ttft_p99_ms'] or 0:,} ms"
        )
    ran_on = doc["cluster"]
    click.echo(f"on {ran_on['kubernetes']} (local: {', '.join(ran_on['nodes'])})")
    click.echo(f"signals from {doc['metrics_source']}")
    for check, result in doc["checks"].items():
        mark = "ok  " if result["ok"] else "FAIL"
        click.echo(f"  {mark} {check}: {result['evidence']}")
    click.echo(f"report: {', '.join(doc['report'])}")
    if not doc["passed"]:
        failed = [k for k, r in doc["checks"].items() if not r["ok"]]
        raise click.ClickException(f"the demo did not show: {', '.join(failed)}")
