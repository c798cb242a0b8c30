"""`kvfleet top NAME`: each engine replica's live numbers, refreshing — role, queue, running
requests, KV-cache usage, prefix-cache hit rate, generation tokens/s.

From the engine pods' own /metrics (SGLang's gauges: `sglang:num_queue_reqs`,
`num_running_reqs`, `token_usage`, `cache_hit_rate`, `gen_throughput`), or from Prometheus
(`--prometheus-url`, series labelled by the PodMonitor with namespace and pod). `--once`
prints one table (scripts, tests); otherwise the view refreshes until Ctrl-C — in place on a
terminal, and as one plain frame per interval when stdout is a pipe or a file.
"""

from __future__ import annotations

import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import click

from kvfleet_cli.admin import Cluster, cluster_options
from kvfleet_cli.completion import isvc_names
from kvfleet_cli.views import table
from kvfleet_kernel.sglang_metrics import promql, read_gauges
from kvfleet_operator.kube import POD
from kvfleet_operator.render.common import (
    COMPONENT_LABEL,
    ENGINE_PORT,
    ISVC_LABEL,
    ROLE_LABEL,
    is_group_worker,
)
from kvfleet_operator.status import pod_ready

SHOWN = ("num_queue_reqs", "num_running_reqs", "token_usage", "cache_hit_rate", "gen_throughput")
"""The gauges a row shows (read and combined as the gateway and the operator read them)."""


@dataclass(frozen=True)
class Replica:
    pod: str
    role: str
    ready: bool
    values: dict[str, float]
    """Gauge name (without the `sglang:` prefix) → value; missing: not scraped."""


def top_table(replicas: list[Replica]) -> str:
    def cell(r: Replica, key: str, fmt: str) -> str:
        return fmt.format(r.values[key]) if key in r.values else "-"

    rows = [
        [r.pod, r.role, "True" if r.ready else "False", cell(r, "num_queue_reqs", "{:g}"),
         cell(r, "num_running_reqs", "{:g}"), cell(r, "token_usage", "{:.0%}"),
         cell(r, "cache_hit_rate", "{:.0%}"), cell(r, "gen_throughput", "{:,.0f}")]
        for r in sorted(replicas, key=lambda r: (r.role, r.pod))
    ]  # fmt: skip
    totals = [
        "TOTAL", f"{len(replicas)} pods", str(sum(r.ready for r in replicas)),
        f"{sum(r.values.get('num_queue_reqs', 0) for r in replicas):g}",
        f"{sum(r.values.get('num_running_reqs', 0) for r in replicas):g}", "", "",
        f"{sum(r.values.get('gen_throughput', 0) for r in replicas):,.0f}",
    ]  # fmt: skip
    headers = ["POD", "ROLE", "READY", "QUEUE", "RUNNING", "KV", "HIT-RATE", "TOKENS/S"]
    return table(headers, [*rows, totals])


def _pod_port(pod: dict[str, Any]) -> int:
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "http":
                return int(p["containerPort"])
    return ENGINE_PORT


def read_replicas(cluster: Cluster, name: str, prometheus_url: str | None) -> list[Replica]:
    selector = f"{ISVC_LABEL}={name},{COMPONENT_LABEL}=engine"
    pods = [  # a multi-node replica is its leader: workers serve no metrics of their own
        p
        for p in cluster.items(POD, cluster.namespace, labelSelector=selector)
        if not is_group_worker(p["metadata"].get("labels") or {})
    ]
    by_pod: dict[str, dict[str, float]] = {}
    if prometheus_url:
        from prometheus_api_client import PrometheusConnect

        prom = PrometheusConnect(url=prometheus_url, disable_ssl=True)
        matchers = f'namespace="{cluster.namespace}", inferenceservice="{name}"'
        for gauge in SHOWN:
            query = promql(gauge, "pod", matchers)
            try:
                result = prom.custom_query(query)
            except Exception as exc:  # unreachable, bad URL: say which
                raise click.ClickException(f"Prometheus at {prometheus_url}: {exc}"[:400]) from None
            for s in result:
                pod = (s.get("metric") or {}).get("pod", "")
                by_pod.setdefault(pod, {})[gauge] = float(s["value"][1])
    else:
        for pod in pods:
            ip = (pod.get("status") or {}).get("podIP")
            if not ip or not pod_ready(pod):
                continue
            try:
                url = f"http://{ip}:{_pod_port(pod)}/metrics"
                with urllib.request.urlopen(url, timeout=3) as r:
                    by_pod[pod["metadata"]["name"]] = read_gauges(r.read().decode())
            except OSError:
                continue  # shown with "-": a replica that does not answer is news too
    return [
        Replica(
            p["metadata"]["name"],
            (p["metadata"].get("labels") or {}).get(ROLE_LABEL, "-"),
            pod_ready(p),
            by_pod.get(p["metadata"]["name"], {}),
        )
        for p in pods
    ]


@click.command("top")
@click.argument("name", shell_complete=isvc_names)
@cluster_options
@click.option("--prometheus-url", default=None, help="Read Prometheus instead of the pods.")
@click.option("--interval", type=float, default=2.0, show_default=True, help="Refresh (s).")
@click.option("--once", is_flag=True, help="Print one table and exit.")
def top(
    name: str,
    kubeconfig: str | None,
    context: str | None,
    namespace: str | None,
    prometheus_url: str | None,
    interval: float,
    once: bool,
) -> None:
    """Live per-replica role, queue, running, KV usage, hit rate and tokens/s of NAME."""
    cluster = Cluster.connect(kubeconfig, context, namespace)
    cluster.isvc(name)
    source = prometheus_url or "the engine pods' /metrics"
    if once:
        replicas = read_replicas(cluster, name, prometheus_url)
        if not replicas:
            raise click.ClickException(f"{cluster.namespace}/{name} has no engine pods yet")
        click.echo(top_table(replicas), nl=False)
        return

    def frame() -> str:
        replicas = read_replicas(cluster, name, prometheus_url)
        stamp = time.strftime("%H:%M:%S")
        header = f"{cluster.namespace}/{name} — {source} — {stamp} (Ctrl-C quits)\n"
        return header + (top_table(replicas) if replicas else "no pods\n")

    try:
        if not sys.stdout.isatty():  # a pipe or a file: whole frames, each as it is read
            while True:
                click.echo(frame())
                sys.stdout.flush()
                time.sleep(interval)
        from rich.live import Live
        from rich.text import Text

        with Live(refresh_per_second=4, screen=False) as live:
            while True:
                live.update(Text(frame()))
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
