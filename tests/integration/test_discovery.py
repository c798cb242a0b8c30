"""Kubernetes discovery over HTTP against the emulated API server (kmock extended with real
semantics): the gateway follows the Ready engine pods matching its selector, by list + watch
from the list's resourceVersion, and routes to their pod IPs."""

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvfleet_gateway.config import KubernetesBackends
from kvfleet_gateway.discovery import pod_url
from kvfleet_localcluster.emulated import EmulatedCluster
from kvfleet_sim.procs import free_port
from tests.support.emulated import emulated_cluster_config as cluster_config
from tests.support.gateway import gateway_config
from tests.support.objects import ENGINE_SELECTOR
from tests.support.objects import engine_pod as pod

SELECTOR = ENGINE_SELECTOR


def test_pod_url_rules() -> None:
    wanted = {"kvfleet.dev/role": "active"}
    assert pod_url(pod("a", "10.0.0.1"), 30000, wanted) == "http://10.0.0.1:30000"
    assert pod_url(pod("a", "10.0.0.1", ready=False), 30000, wanted) is None
    assert pod_url(pod("a", "10.0.0.1", labels={"kvfleet.dev/role": "warm"}), 1, wanted) is None
    terminating = pod("a", "10.0.0.1")
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_url(terminating, 1, wanted) is None
    assert pod_url({"metadata": {"name": "x"}, "status": {}}, 1, {}) is None


async def test_gateway_follows_ready_pods(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    port = free_port()
    engines = [await sim_server(host=f"127.0.0.{i}", port=port) for i in (2, 3, 4)]
    # The API server alone: pods are posted with the statuses the test wants.
    config = cluster_config(tmp_path, controllers=False, crds=False)
    async with EmulatedCluster(config) as cluster:
        url, kubeconfig = cluster.url, cluster.kubeconfig
        async with cluster.session() as s:

            async def put(p: dict[str, Any]) -> None:
                async with s.post(f"{url}/api/v1/namespaces/ai/pods", json=p) as r:
                    assert r.status in (200, 201)

            await put(pod("engine-a", "127.0.0.2"))
            await put(pod("engine-b", "127.0.0.3", ready=False))
            await put(pod("other", "127.0.0.4", labels={"app": "something-else"}))
            cfg = gateway_config(
                kubernetes=KubernetesBackends(
                    namespace="ai", selector=SELECTOR, port=port, kubeconfig=str(kubeconfig)
                )
            )
            gw = await gateway_server(cfg)
            try:
                pool = gateway_server.pool(gw).backends

                async def members(expected: set[str]) -> None:
                    for _ in range(100):
                        if set(pool.backends) == expected and all(
                            b.healthy for b in pool.backends.values()
                        ):
                            return
                        await asyncio.sleep(0.05)
                    pytest.fail(f"pool {set(pool.backends)} != {expected}")

                await members({engines[0]})
                body = {
                    "model": "llama-3.1-8b",
                    "max_tokens": 3,
                    "messages": [{"role": "user", "content": "hi"}],
                }
                async with s.post(f"{gw}/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                # engine-b becomes Ready: it joins
                async with s.patch(
                    f"{url}/api/v1/namespaces/ai/pods/engine-b/status",
                    json={"status": pod("engine-b", "127.0.0.3")["status"]},
                    headers={"Content-Type": "application/merge-patch+json"},
                ) as r:
                    assert r.status == 200
                await members({engines[0], engines[1]})
                # engine-a is deleted: it leaves (drained, then forgotten)
                async with s.delete(f"{url}/api/v1/namespaces/ai/pods/engine-a") as r:
                    assert r.status == 200
                await members({engines[1]})
            finally:
                # Stop the gateway (and its watch) before the API server: a server waits for
                # open watch streams to end before it shuts down.
                await gateway_server.stop(gw)
