"""`kvfleet bench ...`: benchmarks that print numbers, ratios and write reports."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvfleet_sim.bench.fidelity import run_sim_bench
from kvfleet_sim.bench.gateway import run_gateway_bench

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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on the last line.")
def gateway_bench(out_dir: Path, seconds: float, as_json: bool) -> None:
    """Gateway overhead vs direct calls, and throughput vs sglang-router."""
    result = run_gateway_bench(out_dir, lambda m: click.echo(m, err=as_json), seconds)
    click.echo(f"wrote {out_dir / 'gateway.md'} and {out_dir / 'gateway.png'}", err=as_json)
    if as_json:
        click.echo(json.dumps(result))
