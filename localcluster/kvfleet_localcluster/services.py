"""Cluster DNS and kube-proxy for the local cluster's pods.

On a real cluster `redis.ai.svc` (or `redis.ai.svc.cluster.local`, or `redis` from a pod of
namespace `ai`) resolves to the Service's ClusterIP, and kube-proxy forwards a connection to
its port on to a Ready pod the selector matches, at the targetPort. Here there is no DNS
server and no ClusterIP: the cluster's nodes (`cluster_nodes.py`) keep a table — Service →
the Ready pods' addresses and the port mapping — in one JSON file, from watches of pods and
Services through the API server, and the pod shim answers a pod's name lookups from it
(`podshim/sitecustomize.py`), choosing a Ready pod per lookup as kube-proxy chooses per
connection. A Service with no Ready pod resolves to an address that refuses connections, as
a ClusterIP without endpoints does.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvfleet_localcluster.files import replace_file

Json = dict[str, Any]
NO_ENDPOINTS = "127.255.255.254"
"""No pod listens here: a connection is refused, like one to a ClusterIP without endpoints."""


def _target_port(port: Json, pod: Json) -> int | None:
    """A Service port's targetPort on one pod: a number, or a container port's name."""
    target = port.get("targetPort", port.get("port"))
    if isinstance(target, int) or (isinstance(target, str) and target.isdigit()):
        return int(target)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == target:
                return int(p["containerPort"])
    return None


def is_ready(pod: Json) -> bool:
    """The pod's Ready condition is True (what an endpoint and a scrape target need)."""
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """An equality-based selector (a Service's, a matchLabels) matches these labels."""
    return all(labels.get(k) == v for k, v in selector.items())


def table_of(pods: Iterable[Json], services: Iterable[Json]) -> dict[str, list[Json]]:
    """`name.namespace` → endpoints, each `{"ip": ..., "ports": {service port: pod port}}`;
    and for a pod with `hostname` and `subdomain` under a headless Service of that name,
    `hostname.subdomain.namespace` → that pod (its own ports), as cluster DNS publishes
    it (LeaderWorkerSet's workers find their leader so)."""
    by_label: dict[tuple[str, str, str], list[Json]] = defaultdict(list)
    for pod in pods:
        meta = pod["metadata"]
        ip = (pod.get("status") or {}).get("podIP")
        if ip and not meta.get("deletionTimestamp"):
            for k, v in (meta.get("labels") or {}).items():
                by_label[meta["namespace"], k, v].append(pod)
    table: dict[str, list[Json]] = {}
    for svc in services:
        meta, spec = svc["metadata"], svc.get("spec") or {}
        selector: dict[str, str] = spec.get("selector") or {}
        if not selector:
            continue  # endpoints managed by hand: not in the table
        ns = meta["namespace"]
        # Not-ready pods are endpoints only where the Service asks (publishNotReadyAddresses).
        any_state = bool(spec.get("publishNotReadyAddresses"))
        rarest = min(selector.items(), key=lambda kv: len(by_label.get((ns, *kv), ())))
        endpoints = []
        for pod in by_label.get((ns, *rarest), []):
            if not (any_state or is_ready(pod)):
                continue
            if selects(selector, pod["metadata"].get("labels") or {}):
                ports = {
                    str(p["port"]): target
                    for p in spec.get("ports") or []
                    if (target := _target_port(p, pod)) is not None
                }
                endpoints.append({"ip": pod["status"]["podIP"], "ports": ports})
                host = (pod.get("spec") or {}).get("hostname")
                if (
                    spec.get("clusterIP") == "None"
                    and host
                    and ((pod.get("spec") or {}).get("subdomain") == meta["name"])
                ):
                    table[f"{host}.{meta['name']}.{ns}"] = [
                        {"ip": pod["status"]["podIP"], "ports": {}}
                    ]
        table[f"{meta['name']}.{meta['namespace']}"] = endpoints
    return table


class ServiceTable:
    """The node's copy of the table, rewritten (atomically) only when it changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._last: dict[str, list[Json]] | None = None

    def write(self, table: dict[str, list[Json]]) -> None:
        if table == self._last:
            return
        replace_file(self.path, json.dumps({"noEndpoints": NO_ENDPOINTS, "services": table}))
        self._last = table
