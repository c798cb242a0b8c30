"""Around the pods: headless Service, PodMonitors, PodDisruptionBudget, NetworkPolicies."""

from __future__ import annotations

from kvfleet_kernel.schema import Json
from kvfleet_operator.render.common import (
    ENGINE,
    ENGINE_PORT,
    GATEWAY,
    GATEWAY_METRICS_PORT,
    GATEWAY_PORT,
    IG_LABEL,
    ISVC_LABEL,
    KV_EVENTS_PORT,
    KV_REPLAY_PORT,
    PREFILL,
    ROLE_LABEL,
    GatewayOwnerLike,
    Owner,
    service,
    shared_gateway_selector,
)
from kvfleet_operator.render.engine import uses_kv_events

SCRAPER_NAMESPACE_LABEL = "kvfleet.dev/scrape-engines"
"""Namespaces labelled `kvfleet.dev/scrape-engines: "true"` may scrape engine /metrics."""
MONITORING_NAMESPACE = "monitoring"
"""Where `manifests/` installs the operator."""
OPERATOR_POD_LABELS = {
    "app.kubernetes.io/name": "kvfleet",
    "app.kubernetes.io/component": "operator",
}
"""The operator Deployment's pod labels (manifests/base/operator.yaml)."""


def _prom(label: str) -> str:
    """A Kubernetes label as Prometheus service discovery names it."""
    return "".join(c if c.isalnum() else "_" for c in label)


def engine_service(owner: Owner) -> Json:
    """Headless: one DNS record per ready replica, no virtual IP (the gateway routes). Not
    ready addresses are left out by default: a real API server drops a `false` it would
    store (Go's omitempty), so writing it would read back as drift on every resync."""
    if owner.multi_node:
        # Also LeaderWorkerSet's subdomain: a group's workers resolve their leader through it
        # before the leader is ready (it is not, until they join).
        return service(
            owner, owner.engine_name, ENGINE, ENGINE_PORT, clusterIP="None",
            publishNotReadyAddresses=True,
        )  # fmt: skip
    return service(owner, owner.engine_name, ENGINE, ENGINE_PORT, clusterIP="None")


def pod_monitor(owner: Owner, component: str) -> Json:
    """For the Prometheus Operator (plain Prometheus uses the pods' prometheus.io/*
    annotations): the engines' `sglang:*` metrics, and the gateway's TTFT, cost, budget and
    held-request metrics (the autoscaler's scale-from-zero signal)."""
    if component == GATEWAY:
        return gateway_pod_monitor(owner)
    name = owner.engine_name if component == ENGINE else owner.prefill_name
    # Multi-node: the leaders (a worker's /metrics carries no sglang:* series).
    selector = owner.replica_selector() if component == ENGINE else owner.selector(component)
    return _pod_monitor(owner, name, component, selector)


def gateway_pod_monitor(owner: GatewayOwnerLike, shared: bool = False) -> Json:
    """The gateway's; a shared gateway's series carry `inferencegateway` (its name)."""
    source = (IG_LABEL, "inferencegateway") if shared else (ISVC_LABEL, "inferenceservice")
    return _pod_monitor(owner, owner.gateway_name, GATEWAY, owner.selector(GATEWAY), source)


def _pod_monitor(
    owner: GatewayOwnerLike,
    name: str,
    component: str,
    selector: dict[str, str],
    source: tuple[str, str] = (ISVC_LABEL, "inferenceservice"),
) -> Json:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": owner.metadata(name, component),
        "spec": {
            "selector": {"matchLabels": selector},
            "podMetricsEndpoints": [
                {
                    "port": "metrics" if component == GATEWAY else "http",
                    "path": "/metrics",
                    "interval": "15s",
                    "scrapeTimeout": "10s",
                    # The labels alerts, dashboard and autoscaler group by.
                    "relabelings": [
                        {
                            "sourceLabels": [f"__meta_kubernetes_pod_label_{_prom(source[0])}"],
                            "targetLabel": source[1],
                        },
                        {
                            "sourceLabels": [f"__meta_kubernetes_pod_label_{_prom(ROLE_LABEL)}"],
                            "targetLabel": "role",
                        },
                    ],
                }
            ],
        },
    }


def engine_pdb(owner: Owner) -> Json:
    """Voluntary disruptions (node drains) take one replica at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": owner.metadata(owner.engine_name, ENGINE),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": owner.selector(ENGINE)}},
    }


def engine_network_policy(owner: Owner, component: str = ENGINE) -> Json:
    """Only this service's gateway, metrics scrapers and the operator's autoscaler (which
    reads the engines' /metrics when no Prometheus is configured) reach the engine port; only
    the gateway reaches the KV-event ports (prefixIndex: events). A multi-node group's pods
    reach each other, and a disaggregated service's prefill and decode pods each other, on
    any port (NCCL, and the KV transfer's side channels, pick theirs at run time)."""
    port = [{"protocol": "TCP", "port": ENGINE_PORT}]
    gateway_ports = list(port)
    if uses_kv_events(owner.spec):
        gateway_ports += [
            {"protocol": "TCP", "port": KV_EVENTS_PORT},
            {"protocol": "TCP", "port": KV_REPLAY_PORT},
        ]
    front = owner.spec.gateway.inference_gateway
    # Its own gateway's pods, or those of the InferenceGateway that fronts it.
    gateway = shared_gateway_selector(front) if front else owner.selector(GATEWAY)
    ingress: list[Json] = [
        {"from": [{"podSelector": {"matchLabels": gateway}}], "ports": gateway_ports},
        {"from": _scrapers(owner), "ports": port},
    ]
    if owner.multi_node and component == ENGINE:
        ingress.append({"from": [{"podSelector": {"matchLabels": owner.selector(ENGINE)}}]})
    if owner.spec.disaggregation is not None:
        peer = PREFILL if component == ENGINE else ENGINE
        ingress.append({"from": [{"podSelector": {"matchLabels": owner.selector(peer)}}]})
    name = owner.engine_name if component == ENGINE else owner.prefill_name
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": owner.metadata(name, component),
        "spec": {
            "podSelector": {"matchLabels": owner.selector(component)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _scrapers(owner: GatewayOwnerLike) -> list[Json]:
    """Prometheus (the monitoring namespace, or any namespace labelled as a scraper) and the
    operator's autoscaler (its direct reader)."""
    return [
        {
            "namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": MONITORING_NAMESPACE}
            }
        },
        {"namespaceSelector": {"matchLabels": {SCRAPER_NAMESPACE_LABEL: "true"}}},
        {
            "namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": owner.operator_namespace}
            },
            "podSelector": {"matchLabels": OPERATOR_POD_LABELS},
        },
    ]


def gateway_network_policy(owner: GatewayOwnerLike) -> Json:
    """Clients reach the API port from anywhere the cluster's network allows; /metrics (it
    names tenants, budgets, costs and backends) only from scrapers and the operator."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": owner.metadata(owner.gateway_name, GATEWAY),
        "spec": {
            "podSelector": {"matchLabels": owner.selector(GATEWAY)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"protocol": "TCP", "port": GATEWAY_PORT}]},
                {
                    "from": _scrapers(owner),
                    "ports": [{"protocol": "TCP", "port": GATEWAY_METRICS_PORT}],
                },
            ],
        },
    }
