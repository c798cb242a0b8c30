"""The node agent with real processes, on the real control plane (the scheduler binds each
pod to a node, whose agent runs it): ConfigMaps and Secrets mounted where the pod says, a
readiness probe gating Ready, a crashing container restarted with backoff, and a deleted
pod's process stopped after its preStop sleep."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from kvfleet_gateway.keys import hash_key
from tests.support.cluster import Env

IMAGE = "ghcr.io/kvfleet/kvfleet:test"
"""The kvfleet image: its `kvfleet` command runs as this Python's (a real server requires
an image on every container)."""


class Api:
    def __init__(self, url: str, ns: str, s: aiohttp.ClientSession, scale: float) -> None:
        self.url, self.ns, self.s = url, ns, s
        self.scale = scale
        """The nodes' time scale: probe periods, backoff and grace periods times this."""

    async def __call__(self, method: str, kind: str, body: Any = None, name: str = "") -> Any:
        path = f"/api/v1/namespaces/{self.ns}/{kind}" + (f"/{name}" if name else "")
        async with self.s.request(method, self.url + path, json=body) as r:
            answer = await r.json()
            assert r.status < 300, answer
            return answer

    async def pod(self, name: str) -> dict[str, Any]:
        return await self("GET", "pods", name=name)  # type: ignore[no-any-return]


@pytest.fixture
async def api(process_cluster: Env) -> AsyncIterator[Api]:
    cluster = process_cluster.cluster
    async with cluster.session() as s:
        yield Api(cluster.url, process_cluster.ns, s, cluster.config.kubelet.time_scale)


def pod(
    name: str, container: dict[str, Any], volumes: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "containers": [{"image": IMAGE, **container}],
            "volumes": volumes or [],
            "terminationGracePeriodSeconds": 30,
        },
    }


async def until(api: Api, name: str, check: Any, what: str, limit_s: float = 15) -> dict[str, Any]:
    for _ in range(int(limit_s / 0.1)):
        p = await api.pod(name)
        if check(p.get("status") or {}):
            return p
        await asyncio.sleep(0.1)
    pytest.fail(f"pod {name} never reached: {what}; status {p.get('status')}")


def ready(status: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []
    )


async def test_mounts_probes_and_graceful_stop(api: Api) -> None:
    config = {
        "listen": {"port": 8080},
        "models": [{"name": "m", "contextLength": 4096}],
        "backends": {"static": ["http://127.0.0.1:9"]},
        "auth": {"keysFile": "/etc/kvfleet/keys/keys.yaml"},
    }
    keys = {"tenants": [{"name": "t", "keys": [hash_key("secret-key")]}]}
    await api(
        "POST",
        "configmaps",
        {"metadata": {"name": "gw"}, "data": {"gateway.yaml": json.dumps(config)}},
    )
    await api(
        "POST",
        "secrets",
        {"metadata": {"name": "keys"}, "stringData": {"keys.yaml": json.dumps(keys)}},
    )
    container = {
        "name": "gateway",
        "command": ["kvfleet"],
        "args": ["gateway", "--config", "/etc/kvfleet/config/gateway.yaml"],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 5},
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/kvfleet/config"},
            {"name": "keys", "mountPath": "/etc/kvfleet/keys"},
        ],
    }
    volumes = [
        {"name": "config", "configMap": {"name": "gw"}},
        {"name": "keys", "secret": {"secretName": "keys"}},
    ]
    await api("POST", "pods", pod("gw", container, volumes))
    p = await until(api, "gw", ready, "Ready")
    ip = p["status"]["podIP"]
    assert ip.startswith("127.") and ip != "127.0.0.1"  # its cluster's own range (addresses.py)
    async with aiohttp.ClientSession() as s:
        # The Secret's keys are in force (401 without a key); with one, the request reaches
        # the routing stage, where the one backend is down (503).
        async with s.get(f"http://{ip}:8080/v1/models") as r:
            assert r.status == 401
        headers = {"Authorization": "Bearer secret-key"}
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        async with s.post(f"http://{ip}:8080/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 503
    await api("DELETE", "pods", name="gw")
    for _ in range(50):
        try:
            async with aiohttp.ClientSession() as s, s.get(f"http://{ip}:8080/healthz"):
                pass
        except aiohttp.ClientConnectionError:
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("the deleted pod's process still answers")


async def test_a_deleted_pod_serves_through_its_pre_stop_sleep(api: Api) -> None:
    """A real kubelet runs the preStop hook before SIGTERM: an engine's `sleep` keeps it
    serving while gateways drop it (without it, requests routed in the meantime failed).
    Here a sleep of 2 s on the node's time scale, within the grace period (6 s)."""
    import time

    container = {
        "name": "engine",
        "command": ["kvfleet"],
        "args": "sim serve --model llama-3.1-8b --gpu h100 --host 0.0.0.0 --port 30000".split(),
        "readinessProbe": {"httpGet": {"path": "/health", "port": 30000}, "periodSeconds": 5},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(round(2 / api.scale))]}}},
    }
    body = pod("engine", container)
    body["spec"]["terminationGracePeriodSeconds"] = round(6 / api.scale)
    await api("POST", "pods", body)
    ip = (await until(api, "engine", ready, "Ready"))["status"]["podIP"]

    async def answers() -> bool:
        try:
            async with aiohttp.ClientSession() as s, s.get(f"http://{ip}:30000/health") as r:
                return r.status == 200
        except aiohttp.ClientConnectionError:
            return False

    await api("DELETE", "pods", name="engine")
    deleted = time.monotonic()
    await asyncio.sleep(1.0)
    assert await answers(), "stopped before its preStop sleep was over"
    while await answers():
        assert time.monotonic() - deleted < 6, "still serving after its grace period"
        await asyncio.sleep(0.1)
    assert time.monotonic() - deleted >= 1.9


async def test_crashing_container_restarts_with_backoff(api: Api) -> None:
    container = {
        "name": "bad",
        "command": ["kvfleet"],
        "args": ["sim", "serve", "--model", "no-such-model", "--gpu", "h100"],
    }
    await api("POST", "pods", pod("bad", container))
    p = await until(
        api,
        "bad",
        lambda st: (st.get("containerStatuses") or [{}])[0].get("restartCount", 0) >= 2,
        "two restarts",
    )
    cs = p["status"]["containerStatuses"][0]
    assert not cs["ready"]
    waiting = cs["state"].get("waiting") or {}
    assert waiting.get("reason") == "CrashLoopBackOff" or "running" in cs["state"]
