"""The report of `kvfleet bench cluster` (bench/results/cluster.md)."""

from __future__ import annotations

from kvfleet_bench.cluster_scale import (
    CLIENTS,
    OPERATOR_DEFAULT_RESYNC_S,
    ScaleRun,
    Throughput,
)
from kvfleet_localcluster.controlplane_gomod import KUBERNETES_VERSION


def _spread(values: list[float], fmt: str) -> str:
    mid = sorted(values)[len(values) // 2]
    return f"{fmt.format(mid)} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


def resync_section(r: ScaleRun) -> list[str]:
    """The acceptance run: an hour's worth of resyncs of a steady fleet writes nothing."""
    hours = r.resyncs / (3600 / OPERATOR_DEFAULT_RESYNC_S)
    noisy = r.steady_operator_writes or r.steady_events
    return [
        f"## {r.services} InferenceServices, {r.resyncs:.0f} resyncs of each (≈ {hours:.1f} h "
        f"at the default {OPERATOR_DEFAULT_RESYNC_S:.0f} s)",
        "",
        f"{r.gateways} with a gateway (its Secret, ConfigMap, ServiceAccount, Role, "
        "RoleBinding, Deployment, Service, NetworkPolicy), the rest engines only; the operator "
        f"resyncing every {r.resync_s:g} s for {r.steady_window_s:.0f} s once all are Ready, "
        "on the real API server (its defaulting, strict field validation and server-side "
        "apply). Counted at the API server (its flow control's dispatched requests of "
        "FlowSchemas matching the operator's ServiceAccount by verb):",
        "",
        "| measure | value |",
        "|---|---|",
        f"| apply start → all Ready | {r.ready_s:.1f} s |",
        f"| reconciles in the window (services × resyncs) | {r.services * r.resyncs:,.0f} |",
        f"| operator requests (watches excluded) | {r.steady_operator_requests} |",
        f"| … of them writes | {r.steady_operator_writes} |",
        f"| Events created | {r.steady_events} |",
        "",
        f"Goal: 0 writes and 0 Events: **{'not met' if noisy else 'met'}**.",
        "",
    ]


def report(tp: dict[str, list[Throughput]], scale: ScaleRun, resync: ScaleRun) -> str:
    api, base = tp["apiserver"], tp["baseline"]
    ratio = [a.rps / b.rps for a, b in zip(api, base, strict=True)]

    def row(name: str, runs: list[Throughput]) -> str:
        cells = [
            _spread([r.rps for r in runs], "{:,.0f}"),
            _spread([r.per_cpu_s for r in runs], "{:,.0f}"),
            _spread([r.p50_ms for r in runs], "{:.1f}"),
            _spread([r.p99_ms for r in runs], "{:.1f}"),
        ]
        return f"| {name} | " + " | ".join(cells) + " |"

    rows = [
        "# The local cluster at scale",
        "",
        "`make bench` → `kvfleet bench cluster` on this 2-core machine, on the local "
        f"cluster's real control plane (Kubernetes {KUBERNETES_VERSION}; nodes whose pods "
        f"turn Ready without processes). Medians over {len(api)} runs, [min–max].",
        "",
        f"## API throughput: GET one object, {CLIENTS} keep-alive clients, TLS + token + RBAC",
        "",
        "| server | req/s | req per CPU-second | p50 ms | p99 ms |",
        "|---|---|---|---|---|",
        row(f"kube-apiserver {KUBERNETES_VERSION} (all its threads)", api),
        row("baseline: bare aiohttp, same TLS", base),
        "",
        f"The API server reaches {_spread(ratio, '{:.2f}')}× the bare HTTP stack's rate.",
        "",
        f"## {scale.services:,} InferenceServices applied at once",
        "",
        "Gateway disabled, pods without processes (placed by the real scheduler on ten nodes "
        "of 100 H100s); the operator in its own process under its ServiceAccount "
        "(manifests/base/rbac.yaml), resync 20 s. Requests and latency: every client's "
        "(the operator, the controller manager, the scheduler, the node agents), from the "
        "API server's /metrics.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| `kubectl apply -f` of all | {scale.apply_s:.1f} s |",
        f"| apply start → all Ready | {scale.ready_s:.1f} s |",
        f"| API requests in that time (watches excluded) | {scale.requests:,} "
        f"({scale.rps:,.0f}/s) |",
        f"| … of them the operator's | {scale.operator_requests:,} |",
        f"| request latency p50 / p99 (bucket upper bound) | ≤ {scale.p50_ms:g} ms / "
        f"≤ {scale.p99_ms:g} ms |",
        f"| operator requests in a {scale.steady_window_s:.0f} s steady window | "
        f"{scale.steady_operator_requests} |",
        f"| … per service per hour | {scale.per_service_hour:.2f} |",
        "",
        *resync_section(resync),
    ]
    return "\n".join(rows)
