"""Deployments become pods, over HTTP: replicas, readiness with per-pod loopback IPs,
replacement of deleted pods, scaling (with deletion cost), rolling template changes, and
garbage collection of a deleted Deployment's pods."""

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from kvfleet_localcluster.controllers import deletion_order
from tests.support.cluster import Env

DEP = {
    "metadata": {"name": "engine", "labels": {"app": "engine"}},
    "spec": {
        "replicas": 2,
        "selector": {"matchLabels": {"app": "engine"}},
        "template": {
            "metadata": {"labels": {"app": "engine"}},
            "spec": {"containers": [{"name": "e", "image": "kvfleet:1"}]},
        },
    },
}
PODS = "/api/v1/namespaces/ai/pods"
DEPS = "/apis/apps/v1/namespaces/ai/deployments"


class Http:
    def __init__(self, url: str, s: aiohttp.ClientSession) -> None:
        self.url, self.s = url, s

    async def __call__(
        self, method: str, path: str, body: Any = None, ctype: str = "application/merge-patch+json"
    ) -> Any:
        async with self.s.request(
            method,
            self.url + path,
            headers={"Content-Type": ctype},
            data=None if body is None else json.dumps(body),
        ) as r:
            return json.loads(await r.text())

    async def pods(self) -> list[dict[str, Any]]:
        return (await self("GET", PODS))["items"]  # type: ignore[no-any-return]

    async def until(self, check: Callable[[list[dict[str, Any]]], bool]) -> list[Any]:
        for _ in range(100):
            pods = await self.pods()
            if check(pods):
                return pods
            await asyncio.sleep(0.05)
        pytest.fail(f"never reached the expected state: {[p['metadata']['name'] for p in pods]}")


def ready(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in pods if (p.get("status") or {}).get("podIP")]


@pytest.fixture
async def http(local_cluster: Env) -> AsyncIterator[Http]:
    async with local_cluster.cluster.session() as s:
        yield Http(local_cluster.cluster.url, s)


async def test_deployment_pods_scale_replace_roll_and_collect(http: Http) -> None:
    await http("POST", DEPS, DEP, "application/json")
    pods = await http.until(lambda ps: len(ready(ps)) == 2)
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 2 and all(ip.startswith("127.0.0.") for ip in ips)
    assert all(p["metadata"]["ownerReferences"][0]["kind"] == "Deployment" for p in pods)
    dep = await http("GET", f"{DEPS}/engine")
    assert dep["status"]["readyReplicas"] == 2
    assert dep["status"]["observedGeneration"] == dep["metadata"]["generation"]
    # a deleted pod comes back
    await http("DELETE", f"{PODS}/{pods[0]['metadata']['name']}")
    await http.until(
        lambda ps: (
            len(ready(ps)) == 2
            and pods[0]["metadata"]["name"] not in {p["metadata"]["name"] for p in ps}
        )
    )
    # scale to 3 through the scale subresource, then down to 1: deletion cost decides
    await http("PATCH", f"{DEPS}/engine/scale", {"spec": {"replicas": 3}})
    pods = await http.until(lambda ps: len(ready(ps)) == 3)
    keep = pods[0]["metadata"]["name"]
    for p in pods:
        cost = "100" if p["metadata"]["name"] == keep else "0"
        await http(
            "PATCH",
            f"{PODS}/{p['metadata']['name']}",
            {"metadata": {"annotations": {"controller.kubernetes.io/pod-deletion-cost": cost}}},
        )
    await http("PATCH", f"{DEPS}/engine", {"spec": {"replicas": 1}})
    pods = await http.until(lambda ps: len(ps) == 1)
    assert pods[0]["metadata"]["name"] == keep
    # a template change rolls the pod to the new template
    await http(
        "PATCH",
        f"{DEPS}/engine",
        {"spec": {"template": {"spec": {"containers": [{"name": "e", "image": "kvfleet:2"}]}}}},
    )
    pods = await http.until(
        lambda ps: (
            len(ps) == 1 and ready(ps) and ps[0]["spec"]["containers"][0]["image"] == "kvfleet:2"
        )
    )
    # deleting the Deployment collects its pods
    await http("DELETE", f"{DEPS}/engine")
    await http.until(lambda ps: not ps)


def test_deletion_order_follows_the_replicaset_controller() -> None:
    def pod(name: str, ready: bool, created: str, cost: int = 0) -> dict[str, Any]:
        return {
            "metadata": {
                "name": name,
                "creationTimestamp": created,
                "annotations": {"controller.kubernetes.io/pod-deletion-cost": str(cost)},
            },
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        }

    pods = [
        pod("old-ready", True, "2026-01-01T00:00:00Z"),
        pod("new-ready", True, "2026-01-02T00:00:00Z"),
        pod("not-ready", False, "2026-01-01T00:00:00Z"),
        pod("precious", False, "2026-01-03T00:00:00Z", cost=10),
    ]
    # Kubernetes' ActivePodsWithRanks: not ready < ready, then lower deletion cost, then newer.
    pods.append(pod("cheap-ready", True, "2026-01-01T00:00:00Z", cost=-100))
    assert [p["metadata"]["name"] for p in deletion_order(pods)] == [
        "not-ready",
        "precious",
        "cheap-ready",
        "new-ready",
        "old-ready",
    ]
