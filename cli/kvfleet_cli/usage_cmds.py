"""`kvfleet usage`: tokens, requests, budget left and cost per tenant (or tenant × model),
from the gateways of an InferenceService or of an InferenceGateway.

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
    BUDGET_REMAINING_COST,
    BUDGET_RESERVED,
    COST,
    REQUESTS,
    TOKENS,
)
from kvfleet_operator.kube import IGW, POD
from kvfleet_operator.render.common import (
    COMPONENT_LABEL,
    GATEWAY_METRICS_PORT,
    IG_LABEL,
    ISVC_LABEL,
)

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
    cost_left: float | None = None
    """A cost budget less what was spent, in the models' price currency."""

    @property
    def total_requests(self) -> float:
        return sum(self.requests.values())

    @property
    def billed_tokens(self) -> float:
        return self.tokens.get("prompt", 0.0) + self.tokens.get("completion", 0.0)


def aggregate(
    samples: Iterable[Sample], tenant: str | None = None, by_model: bool = False
) -> dict[str, TenantUsage]:
    """Samples of the gateway's metrics (any number of gateways) → usage per tenant, or per
    `tenant × model` (budgets, which span models, on each of the tenant's rows)."""
    out: dict[str, TenantUsage] = {}
    budgets: dict[str, TenantUsage] = {}
    for name, labels, value in samples:
        who = labels.get("tenant")
        if who is None or (tenant is not None and who != tenant):
            continue
        if name in (BUDGET_REMAINING, BUDGET_RESERVED, BUDGET_REMAINING_COST):
            _budget(budgets.setdefault(who, TenantUsage()), name, value)
            continue
        if name not in (f"{REQUESTS}_total", f"{TOKENS}_total", f"{COST}_total"):
            continue
        key = f"{who} × {labels.get('model', '?')}" if by_model else who
        u = out.setdefault(key, TenantUsage())
        if name == f"{REQUESTS}_total":
            status = labels.get("status", "?")
            u.requests[status] = u.requests.get(status, 0.0) + value
        elif name == f"{TOKENS}_total":
            kind = labels.get("kind", "?")
            u.tokens[kind] = u.tokens.get(kind, 0.0) + value
        elif name == f"{COST}_total":
            u.cost += value
    for key, u in out.items():
        b = budgets.get(key.split(" × ")[0])
        if b is not None:
            u.budget_left, u.budget_reserved, u.cost_left = (
                b.budget_left,
                b.budget_reserved,
                b.cost_left,
            )
    return out


def _least(old: float | None, value: float) -> float:
    return value if old is None else min(old, value)


def _budget(u: TenantUsage, name: str, value: float) -> None:
    """Every gateway reports the shared budget: the smallest is the freshest (and each the
    reserved total it last saw: settled gateways see less)."""
    if name == BUDGET_REMAINING:
        u.budget_left = _least(u.budget_left, value)
    elif name == BUDGET_RESERVED:
        u.budget_reserved = _least(u.budget_reserved, value)
    else:
        u.cost_left = _least(u.cost_left, value)


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
            _left(u),
            "-" if u.budget_reserved is None else f"{u.budget_reserved:,.0f}",
            f"{u.cost:.4f}", per_1k,
        ])  # fmt: skip
    headers = ["TENANT", "REQUESTS", "OK", "429", "PROMPT", "COMPLETION", "CACHED",
               "BUDGET-LEFT", "RESERVED", "COST", "COST/1K"]  # fmt: skip
    return table(headers, rows)


def _left(u: TenantUsage) -> str:
    if u.cost_left is not None:
        return f"{u.cost_left:,.4f} (cost)"
    return "-" if u.budget_left is None else f"{u.budget_left:,.0f}"


def parse_exposition(text: str) -> list[Sample]:
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def _from_pods(cluster: Cluster, name: str, label: str) -> tuple[list[Sample], str]:
    selector = f"{label}={name},{COMPONENT_LABEL}=gateway"
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


def _from_prometheus(
    url: str, namespace: str, name: str, since: str, target: str
) -> tuple[list[Sample], str]:
    """`target`: the label the PodMonitor gives the gateway's series (inferenceservice, or
    inferencegateway for a shared gateway)."""
    from prometheus_api_client import PrometheusConnect

    prom = PrometheusConnect(url=url, disable_ssl=True)
    where = f'namespace="{namespace}", {target}="{name}"'

    def increase(metric: str, by: str) -> str:
        return f"sum by ({by}) (increase({metric}{{{where}}}[{since}]))"

    queries = {
        f"{REQUESTS}_total": increase(f"{REQUESTS}_total", "tenant, model, status"),
        f"{TOKENS}_total": increase(f"{TOKENS}_total", "tenant, model, kind"),
        f"{COST}_total": increase(f"{COST}_total", "tenant, model"),
        **{
            gauge: f"min by (tenant) ({gauge}{{{where}}})"
            for gauge in (BUDGET_REMAINING, BUDGET_RESERVED, BUDGET_REMAINING_COST)
        },
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
@click.option("--by-model", is_flag=True, help="One row per tenant and model.")
@click.option(
    "--gateway", "shared", is_flag=True, help="NAME is an InferenceGateway (a shared gateway)."
)
def usage(
    name: str,
    kubeconfig: str | None,
    context: str | None,
    namespace: str | None,
    tenant: str | None,
    since: str,
    prometheus_url: str | None,
    by_model: bool,
    shared: bool,
) -> None:
    """Tokens, requests (OK, 429), budget left and cost per tenant (or per tenant and model)
    of NAME's gateway."""
    if not _SINCE.match(since):
        raise click.UsageError(f"--since {since!r}: a duration like 30m, 1h, 7d")
    cluster = Cluster.connect(kubeconfig, context, namespace)
    if shared:
        cluster.get(IGW.path(cluster.namespace, name))
    else:
        cluster.isvc(name)
    label, target = (IG_LABEL, "inferencegateway") if shared else (ISVC_LABEL, "inferenceservice")
    if prometheus_url:
        samples, source = _from_prometheus(prometheus_url, cluster.namespace, name, since, target)
    else:
        samples, source = _from_pods(cluster, name, label)
    result = aggregate(samples, tenant, by_model)
    if not result:
        who = f"tenant {tenant!r}" if tenant else "any tenant"
        click.echo(f"no usage by {who} ({source})", err=True)
        return
    click.echo(f"# {cluster.namespace}/{name}: {source}", err=True)
    click.echo(usage_table(result), nl=False)
