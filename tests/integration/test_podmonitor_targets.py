"""The Prometheus Operator's part for a plain Prometheus (what `kvfleet demo` runs): PodMonitors
and pods watched through a real API server become a file_sd file — each Ready pod a
PodMonitor selects, at its named port and path, with the operator's target labels and the
endpoint's relabelings — and a pod that goes away leaves it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kvfleet_localcluster.kubeapi import PODS, KubeClient
from kvfleet_localcluster.kubelet import cancel_and_wait
from kvfleet_localcluster.local import LocalCluster
from kvfleet_localcluster.podmonitors import PODMONITOR_RESOURCE, PodMonitorTargets
from tests.support.cluster import cluster_config

PODMONITOR = {
    "apiVersion": "monitoring.coreos.com/v1",
    "kind": "PodMonitor",
    "metadata": {"name": "engines", "namespace": "ai"},
    "spec": {
        "selector": {"matchLabels": {"app": "engine"}},
        "podMetricsEndpoints": [
            {
                "port": "metrics",
                "path": "/m",
                "relabelings": [
                    {"sourceLabels": ["__meta_kubernetes_pod_label_kvfleet_dev_role"],
                     "targetLabel": "role"},
                ],
            }
        ],
    },
}  # fmt: skip


def pod(name: str, app: str) -> dict[str, Any]:
    port = {"name": "metrics", "containerPort": 30000}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": app, "kvfleet.dev/role": "warm"}},
        "spec": {"containers": [{"name": "engine", "image": "sim", "ports": [port]}]},
    }


async def until(check: Any, what: str, timeout_s: float = 60.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if found := check():
            return found
        await asyncio.sleep(0.2)
    pytest.fail(f"timed out: {what}")


@pytest.mark.timeout(240)
async def test_the_podmonitors_ready_pods_become_file_sd_targets(tmp_path: Path) -> None:
    config = dataclasses.replace(cluster_config(tmp_path), monitoring_crds=True)
    sd_file = tmp_path / "targets.json"

    def targets() -> list[dict[str, Any]]:
        return list(json.loads(sd_file.read_text())) if sd_file.exists() else []

    async with (
        LocalCluster(config) as cluster,
        KubeClient(cluster.url, cluster.ca_pem, "test", cluster.admin_token) as client,
    ):
        task = asyncio.create_task(PodMonitorTargets(client, sd_file).run())
        try:
            await client.create(PODMONITOR_RESOURCE, "ai", PODMONITOR)
            await client.create(PODS, "ai", pod("engine-a", "engine"))
            await client.create(PODS, "ai", pod("other", "gateway"))
            (group,) = await until(targets, "the engine pod as a target")
            ip = (await client.get(PODS, "ai", "engine-a"))["status"]["podIP"]
            assert group == {
                "targets": [f"{ip}:30000"],
                "labels": {
                    "namespace": "ai", "pod": "engine-a", "container": "engine",
                    "endpoint": "metrics", "job": "ai/engines", "__metrics_path__": "/m",
                    "role": "warm",
                },
            }  # fmt: skip
            await client.delete(PODS, "ai", "engine-a", grace_seconds=0)
            await until(lambda: sd_file.exists() and targets() == [], "the target gone")
        finally:
            await cancel_and_wait(task)
