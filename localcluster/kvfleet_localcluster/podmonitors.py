"""What the Prometheus Operator does with PodMonitors, for a plain Prometheus beside the local
cluster: each PodMonitor's pods (its selector, in its namespace) become scrape targets of a
`file_sd_configs` file, at the named container port and path of each podMetricsEndpoint, with
the target labels the operator would give them (namespace, pod, container, endpoint, job) and
the endpoint's `replace` relabelings of pod labels applied — so the series carry exactly the
labels the rendered PodMonitor asks for, and a wrong PodMonitor shows up as missing labels.

(Debian's Prometheus is built without Kubernetes service discovery, so it cannot watch the
API server itself: `PodMonitorTargets` watches PodMonitors and pods through the API, as the
Prometheus Operator does, and rewrites the file.) The PodMonitor CRD is the Prometheus
Operator's own, which the control plane installs (`controlplane_build.Binaries.monitoring_crds`).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvfleet_localcluster.files import replace_file
from kvfleet_localcluster.kubeapi import PODS, KubeClient, Resource
from kvfleet_localcluster.reflector import Reflector
from kvfleet_localcluster.services import is_ready, selects

Json = dict[str, Any]
PODMONITOR_RESOURCE = Resource("monitoring.coreos.com", "v1", "podmonitors")
POD_LABEL_META = "__meta_kubernetes_pod_label_"


def _meta_name(label: str) -> str:
    """A pod label as Prometheus's Kubernetes discovery names it."""
    return POD_LABEL_META + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _container_port(pod: Json, name: str) -> tuple[str, int] | None:
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == name:
                return c.get("name", ""), int(p["containerPort"])
    return None


def targets_of(podmonitors: Iterable[Json], pods: Iterable[Json]) -> list[Json]:
    """file_sd target groups for every PodMonitor's running, ready pods."""
    by_namespace: dict[str, list[Json]] = {}
    for pod in pods:
        by_namespace.setdefault(pod["metadata"].get("namespace", ""), []).append(pod)
    groups: list[Json] = []
    for pm in podmonitors:
        ns, spec = pm["metadata"]["namespace"], pm.get("spec") or {}
        selector = (spec.get("selector") or {}).get("matchLabels") or {}
        for pod in sorted(by_namespace.get(ns, []), key=lambda p: p["metadata"]["name"]):
            meta = pod["metadata"]
            labels = meta.get("labels") or {}
            ip = (pod.get("status") or {}).get("podIP")
            if not ip or not is_ready(pod) or not selects(selector, labels):
                continue
            groups += _pod_targets(pm, pod, ip)
    return groups


def _pod_targets(pm: Json, pod: Json, ip: str) -> list[Json]:
    ns, meta = pm["metadata"]["namespace"], pod["metadata"]
    discovered = {_meta_name(k): v for k, v in (meta.get("labels") or {}).items()}
    groups: list[Json] = []
    for ep in (pm.get("spec") or {}).get("podMetricsEndpoints") or []:
        port = _container_port(pod, ep.get("port", ""))
        if port is None:
            continue
        target = {
            "namespace": ns,
            "pod": meta["name"],
            "container": port[0],
            "endpoint": ep["port"],
            "job": f"{ns}/{pm['metadata']['name']}",
            "__metrics_path__": ep.get("path", "/metrics"),
        }
        for r in ep.get("relabelings") or []:
            if r.get("action", "replace") == "replace" and r.get("targetLabel"):
                values = [discovered.get(s, "") for s in r.get("sourceLabels") or []]
                target[r["targetLabel"]] = r.get("separator", ";").join(values)
        groups.append({"targets": [f"{ip}:{port[1]}"], "labels": target})
    return groups


class PodMonitorTargets:
    """The file_sd file of a cluster's PodMonitors, kept current from watches of PodMonitors
    and pods through the API (any API server: `client` logs in as whoever may list both),
    rewritten only when the targets change.

        task = asyncio.create_task(PodMonitorTargets(client, path).run())
    """

    def __init__(self, client: KubeClient, path: Path) -> None:
        self.path = path
        self._written: str | None = None
        self._podmonitors = Reflector(client, PODMONITOR_RESOURCE, self._write)
        self._pods = Reflector(client, PODS, self._write)

    def _write(self) -> None:
        if not (self._podmonitors.synced.is_set() and self._pods.synced.is_set()):
            return
        text = json.dumps(
            targets_of(self._podmonitors.items.values(), self._pods.items.values()),
            sort_keys=True,
        )
        if text != self._written:
            replace_file(self.path, text)
            self._written = text

    async def run(self) -> None:
        """Watch until cancelled; the file exists (maybe empty) once both lists arrived."""
        await asyncio.gather(self._podmonitors.run(), self._pods.run())
