"""Kubernetes discovery over HTTP against the real API server: the gateway follows the Ready
engine pods matching its selector, by list + watch from the list's resourceVersion, and
routes to their pod IPs."""

import asyncio
from typing import Any

import aiohttp
import pytest

from kvfleet_gateway.config import KubernetesBackends
from kvfleet_gateway.discovery import pod_url
from kvfleet_sim.procs import free_port
from tests.support.cluster import Env, create_pod_no_node_runs, write_pod_status
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
    sim_server: Any, gateway_server: Any, local_cluster: Env
) -> None:
    port = free_port()
    engines = [await sim_server(host=f"127.0.0.{i}", port=port) for i in (2, 3, 4)]
    cluster, ns = local_cluster.cluster, local_cluster.ns
    pods = f"{cluster.url}/api/v1/namespaces/{ns}/pods"
    async with cluster.session() as s:
        for p in (
            pod("engine-a", "127.0.0.2"),
            pod("engine-b", "127.0.0.3", ready=False),
            pod("other", "127.0.0.4", labels={"app": "something-else"}),
        ):
            await create_pod_no_node_runs(local_cluster, p)
        cfg = gateway_config(
            kubernetes=KubernetesBackends(
                namespace=ns, selector=SELECTOR, port=port, kubeconfig=str(local_cluster.kubeconfig)
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
            async with (
                aiohttp.ClientSession() as client,
                client.post(f"{gw}/v1/chat/completions", json=body) as r,
            ):
                assert r.status == 200
            # engine-b becomes Ready: it joins
            await write_pod_status(
                local_cluster, "engine-b", pod("engine-b", "127.0.0.3")["status"]
            )
            await members({engines[0], engines[1]})
            # engine-a is deleted: it leaves (drained, then forgotten). Bound to no node, it
            # is gone at once, as a real API server deletes a pod no kubelet runs.
            async with s.delete(f"{pods}/engine-a") as r:
                assert r.status == 200
            await members({engines[1]})
        finally:
            await gateway_server.stop(gw)
