"""`kvfleet cluster up`: the local cluster — the real Kubernetes control plane built from its
Go modules, and node agents that run pods as processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from pathlib import Path

import click

from kvfleet_localcluster.cluster_nodes import DEFAULT_NODES
from kvfleet_localcluster.controlplane import ControlPlaneError
from kvfleet_localcluster.controlplane_build import GoMissing
from kvfleet_localcluster.kubelet import KubeletConfig
from kvfleet_localcluster.local import LocalCluster, LocalClusterConfig
from kvfleet_localcluster.node_agent import NodeSpec


@click.group("cluster")
def cluster() -> None:
    """A local Kubernetes cluster: the real control plane, pods run as processes on 127.x."""


@cluster.command("up")
@click.option(
    "--kubeconfig",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write the kubeconfig.",
)
@click.option("--no-processes", is_flag=True, help="Pods become Ready after a delay; nothing runs.")
@click.option(
    "--no-monitoring-crds",
    is_flag=True,
    help="A cluster without the Prometheus Operator: no PodMonitor / PrometheusRule CRDs.",
)
@click.option(
    "--node",
    "nodes",
    multiple=True,
    metavar="NAME[:GPUS[:PRODUCT]]",
    help="A simulated node (repeatable), e.g. gpu-a:8:NVIDIA-H100-80GB-HBM3 or cpu-a:0; "
    "default: six nodes of 8 H100s, one each of 8 H200s, A100s and L40Ss.",
)
@click.option("--no-lws", is_flag=True, help="Do not run the LeaderWorkerSet controller.")
@click.option(
    "--namespace",
    default=LocalClusterConfig.namespace,
    show_default=True,
    help="The kubeconfig's namespace.",
)
@click.option(
    "--crds",
    "crds_dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    help="Apply the CRDs in this directory at start (e.g. crds/).",
)
@click.option(
    "--time-scale",
    type=float,
    default=KubeletConfig.time_scale,
    show_default=True,
    help="Kubelet timing (probes, backoff, grace) relative to a real node.",
)
@click.option(
    "--engine-time-scale",
    type=float,
    default=KubeletConfig.engine_time_scale,
    show_default=True,
    help="Simulated engines' wall seconds per GPU second.",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Pod volumes and logs (default: a temporary directory).",
)
@click.option(
    "--kvfleet-image-command",
    default=None,
    help="The `kvfleet` executable that runs kvfleet-image pods (gateway, operator); default: "
    "this Python's. Point it at a runtime-only install to test what the image ships.",
)
@click.option("--log-level", default="info", show_default=True)
def up(
    kubeconfig: Path,
    no_processes: bool,
    no_monitoring_crds: bool,
    nodes: tuple[str, ...],
    no_lws: bool,
    namespace: str,
    crds_dir: Path | None,
    time_scale: float,
    engine_time_scale: float,
    state_dir: Path | None,
    kvfleet_image_command: str | None,
    log_level: str,
) -> None:
    """Start the local cluster and run it until Ctrl-C (or SIGTERM)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    kubelet = KubeletConfig(
        run_processes=not no_processes,
        time_scale=time_scale,
        engine_time_scale=engine_time_scale,
        state_dir=state_dir.resolve() if state_dir else None,
        kvfleet_command=(
            (kvfleet_image_command,) if kvfleet_image_command else KubeletConfig.kvfleet_command
        ),
    )
    config = LocalClusterConfig(
        kubeconfig=kubeconfig.resolve(),
        namespace=namespace,
        lws=not no_lws,
        nodes=tuple(parse_node(n) for n in nodes) or DEFAULT_NODES,
        crds_dir=crds_dir,
        monitoring_crds=not no_monitoring_crds,
        kubelet=kubelet,
    )
    try:
        asyncio.run(_serve(LocalCluster(config), kubelet.run_processes))
    except (GoMissing, ControlPlaneError) as exc:
        raise click.ClickException(str(exc)) from exc


def parse_node(text: str) -> NodeSpec:
    """`NAME[:GPUS[:PRODUCT]]` → a node; a clear error for anything else."""
    name, _, rest = text.partition(":")
    gpus_text, _, product = rest.partition(":")
    if not name or (gpus_text and not gpus_text.isdigit()):
        raise click.BadParameter(f"{text!r}: expected NAME[:GPUS[:PRODUCT]], e.g. gpu-a:8")
    gpus = int(gpus_text) if gpus_text else NodeSpec.gpus
    return NodeSpec(name, gpus=gpus, gpu_product=product or NodeSpec.gpu_product)


async def _serve(cluster: LocalCluster, run_processes: bool) -> None:
    started = time.monotonic()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with cluster as local:
        mode = "pods run as processes" if run_processes else "no pod processes"
        click.echo(f"kvfleet local cluster: API server {local.url} ({mode})")
        click.echo(f"kubeconfig: {local.kubeconfig}")
        click.echo(f"  kubectl --kubeconfig {local.kubeconfig} get pods -A")
        click.echo(
            f"ready in {time.monotonic() - started:.2f}s; Ctrl-C stops it and every pod", err=True
        )
        await stop.wait()
        click.echo("stopping pods ...", err=True)
    with contextlib.suppress(NotImplementedError):
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    click.echo("stopped", err=True)


@cluster.command("build")
@click.option(
    "--gomod",
    is_flag=True,
    help="First regenerate localcluster/controlplane/go.mod (and lws/go.mod) from the upstream "
    "k8s.io/kubernetes go.mod, then `go mod tidy` (after changing a pinned version).",
)
def build(gomod: bool) -> None:
    """Build the real control plane (kube-apiserver, controller manager, scheduler, etcd, the
    LeaderWorkerSet controller) from its Go modules; a no-op when already built."""
    from kvfleet_localcluster import controlplane_build, controlplane_gomod

    if gomod:
        controlplane_gomod.regenerate()
    try:
        binaries = controlplane_build.ensure_built()
    except controlplane_build.GoMissing as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(binaries.directory)
