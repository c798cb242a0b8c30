"""The `kvfleet` command."""

from __future__ import annotations

import click

from kvfleet_cli.bench_cmds import bench
from kvfleet_cli.cluster_cmds import cluster
from kvfleet_cli.demo import demo
from kvfleet_cli.gateway_cmds import gateway, keys
from kvfleet_cli.operator_cmds import crds, operator, render
from kvfleet_cli.sim_cmds import sim


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvfleet")
def cli() -> None:
    """kvfleet: LLM inference on Kubernetes — operator, gateway and a GPU-free SGLang simulator."""


cli.add_command(sim)
cli.add_command(bench)
cli.add_command(demo)
cli.add_command(gateway)
cli.add_command(keys)
cli.add_command(render)
cli.add_command(crds)
cli.add_command(operator)
cli.add_command(cluster)
