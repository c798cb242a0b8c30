"""`kvfleet usage`: tokens, requests, budget left and cost per tenant, from the gateways.

Two sources, as the autoscaler has: Prometheus (`--prometheus-url`; over `--since`, e.g. 1h,
with `increase()`), or the gateway pods' own /metrics (since each gateway started; summed
over the gateways). The aggregation is one pure function over samples, whichever the source.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import click

from kvfleet_cli.admin import Cluster, cluster_options
from kvfleet_cli.completion import isvc_names
from kvfleet_cli.views import table
from kvfleet_kernel.sglang_metrics import (
    BUDGET_REMAINING,
    BUDGET_RESERVED,
    COST,
    REQUESTS,
    TOKENS,
)
from kvfleet_operator.kube import POD
from kvfleet_operator.render.common import COMPONENT_LABEL, GATEWAY_METRICS_PORT, ISVC_LABEL

Sample = tuple[str, dict[str, str], float]


@dataclass
class TenantUsage:
    requests: dict[str, float] = field(default_factory=dict)
    """HTTP status → requests."""
    tokens: dict[str, float] = field(default_factory=dict)
    """prompt / completion / cached → tokens."""
    cost: float = 0.0
    budget_left: float | None = None
    """The budget less what was spent (as of the gateways' last admission or settlement)."""
    budget_reserved: float | None = None
    """Reserved by requests in flight: each holds its upper bound until it settles."""

    @property
    def total_requests(self) -> float:
        return sum(self.requests.values())

    @property
    def billed_tokens(self) -> float:
        return self.tokens.get("prompt", 0.0) + self.tokens.get("completion", 0.0)


def aggregate(samples: Iterable[Sample], tenant: str | None = None) -> dict[str, TenantUsage]:
    """Samples of the gateway's metrics (any number of gateways) → usage per tenant."""
    out: dict[str, TenantUsage] = {}
    for name, labels, value in samples:
        who = labels.get("tenant")
        if who is None or (tenant is not None and who != tenant):
            continue
        u = out.setdefault(who, TenantUsage())
        if name == f"{REQUESTS}_total":
            status = labels.get("status", "?")
            u.requests[status] = u.requests.get(status, 0.0) + value
        elif name == f"{TOKENS}_total":
            kind = labels.get("kind", "?")
            u.tokens[kind] = u.tokens.get(kind, 0.0) + value
        elif name == f"{COST}_total":
            u.cost += value
        elif name == BUDGET_REMAINING:
            # Every gateway reports the shared budget: the smallest is the freshest.
            u.budget_left = value if u.budget_left is None else min(u.budget_left, value)
        elif name == BUDGET_RESERVED:
            # Each gateway reports the shared total it last saw; settled gateways see less.
            u.budget_reserved = (
                value if u.budget_reserved is None else min(u.budget_reserved, value)
            )
    return out


def usage_table(usage: dict[str, TenantUsage]) -> str:
    rows = []
    for name, u in sorted(usage.items()):
        ok = sum(v for s, v in u.requests.items() if s.startswith("2"))
        limited = u.requests.get("429", 0.0)
        per_1k = f"{u.cost / u.billed_tokens * 1000:.4f}" if u.billed_tokens else "-"
        rows.append([
            name, f"{u.total_requests:,.0f}", f"{ok:,.0f}", f"{limited:,.0f}",
            f"{u.tokens.get('prompt', 0):,.0f}", f"{u.tokens.get('completion', 0):,.0f}",
            f"{u.tokens.get('cached', 0):,.0f}",
            "-" if u.budget_left is None else f"{u.budget_left:,.0f}",
            "-" if u.budget_reserved is None else f"{u.budget_reserved:,.0f}",
            f"{u.cost:.4f}", per_1k,
        ])  # fmt: skip
    headers = ["TENANT", "REQUESTS", "OK", "429", "PROMPT", "COMPLETION", "CACHED",
               "BUDGET-LEFT", "RESERVED", "COST", "COST/1K"]  # fmt: skip
    return table(headers, rows)


def parse_exposition(text: str) -> list[Sample]:
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def _from_pods(cluster: Cluster, name: str) -> tuple[list[Sample], str]:
    selector = f"{ISVC_LABEL}={name},{COMPONENT_LABEL}=gateway"
    pods = cluster.items(POD, cluster.namespace, labelSelector=selector)
    samples: list[Sample] = []
    read = 0
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            continue
        try:
            url = f"http://{ip}:{GATEWAY_METRICS_PORT}/metrics"
            with urllib.request.urlopen(url, timeout=5) as r:
                samples += parse_exposition(r.read().decode())
            read += 1
        except OSError as exc:
            click.echo(f"[pod/{pod['metadata']['name']}] cannot scrape {url}: {exc}", err=True)
    if not read:
        raise click.ClickException(
            f"no gateway pod of {cluster.namespace}/{name} could be scraped (outside the "
            "cluster's network? use --prometheus-url)"
        )
    return samples, f"{read} gateway pod(s), since each started"


_SINCE = re.compile(r"^\d+[smhdw]$")


def _from_prometheus(url: str, namespace: str, name: str, since: str) -> tuple[list[Sample], str]:
    from prometheus_api_client import PrometheusConnect

    prom = PrometheusConnect(url=url, disable_ssl=True)
    where = f'namespace="{namespace}", inferenceservice="{name}"'

    def increase(metric: str, by: str) -> str:
        return f"sum by ({by}) (increase({metric}{{{where}}}[{since}]))"

    queries = {
        f"{REQUESTS}_total": increase(f"{REQUESTS}_total", "tenant, status"),
        f"{TOKENS}_total": increase(f"{TOKENS}_total", "tenant, kind"),
        f"{COST}_total": increase(f"{COST}_total", "tenant"),
        BUDGET_REMAINING: f"min by (tenant) ({BUDGET_REMAINING}{{{where}}})",
        BUDGET_RESERVED: f"min by (tenant) ({BUDGET_RESERVED}{{{where}}})",
    }
    samples: list[Sample] = []
    try:
        for metric, query in queries.items():
            for s in prom.custom_query(query):
                labels: dict[str, Any] = s.get("metric") or {}
                samples.append(
                    (metric, {k: str(v) for k, v in labels.items()}, float(s["value"][1]))
                )
    except Exception as exc:  # unreachable, bad URL, query error: say which
        raise click.ClickException(f"Prometheus at {url}: {exc}"[:400]) from None
    return samples, f"Prometheus, last {since}"


@click.command("usage")
@click.argument("name", shell_complete=isvc_names)
@cluster_options
@click.option("--tenant", default=None, help="Only this tenant.")
@click.option("--since", default="1h", show_default=True, help="With --prometheus-url: window.")
@click.option("--prometheus-url", default=None, help="Read Prometheus instead of the pods.")
def usage(
    name: str,
    kubeconfig: str | None,
    context: str | None,
    namespace: str | None,
    tenant: str | None,
    since: str,
    prometheus_url: str | None,
) -> None:
    """Tokens, requests (OK, 429), budget left and cost per tenant of NAME's gateway."""
    if not _SINCE.match(since):
        raise click.UsageError(f"--since {since!r}: a duration like 30m, 1h, 7d")
    cluster = Cluster.connect(kubeconfig, context, namespace)
    cluster.isvc(name)
    if prometheus_url:
        samples, source = _from_prometheus(prometheus_url, cluster.namespace, name, since)
    else:
        samples, source = _from_pods(cluster, name)
    result = aggregate(samples, tenant)
    if not result:
        who = f"tenant {tenant!r}" if tenant else "any tenant"
        click.echo(f"no usage by {who} ({source})", err=True)
        return
    click.echo(f"# {cluster.namespace}/{name}: {source}", err=True)
    click.echo(usage_table(result), nl=False)
