"""Scale from zero at the gateway: with no replica to serve a model, requests are held (a
bounded queue with a deadline, exported as `kvfleet_gateway_held_requests`) until one
appears; past the deadline they get 503 `no_capacity` with Retry-After, and nothing is
billed.

The replicas are pods no node runs (a scheduling gate keeps the scheduler off them), in the
test's namespace of the worker's shared cluster, whose status the test writes as a kubelet
would: Ready, at the address of an engine it started itself."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvfleet_gateway.config import (
    Duration,
    GatewayConfig,
    Hold,
    KubernetesBackends,
    Limits,
    ModelConfig,
    PrefillBackends,
    TokenBudget,
)
from kvfleet_gateway.keys import hash_key
from kvfleet_sim.procs import free_port
from tests.support.cluster import Env, create_pod_no_node_runs
from tests.support.gateway import budget_in_use, gateway_config, metrics_url
from tests.support.objects import ENGINE_SELECTOR, engine_pod
from tests.support.waiting import until

KEY = "kvf-hold-test"
ENGINE_PORT = 30000
CHAT = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def keys(tmp: Path) -> Path:
    f = tmp / "keys.yaml"
    f.write_text(json.dumps({"tenants": [{"name": "t", "keys": [hash_key(KEY)]}]}))
    return f


async def post(url: str) -> tuple[int, dict[str, str], Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{url}/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"}
        ) as r,
    ):
        return r.status, dict(r.headers), await r.json()


async def held(url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith("kvfleet_gateway_held_requests{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def replica_arrives(
    env: Env, name: str, ip: str, labels: dict[str, str] | None = None
) -> None:
    """A pod of `env`'s namespace, Ready at `ip`, as the kubelet reports it."""
    pod = engine_pod(name, ip, labels=labels)
    pod["status"] = {**pod["status"], "phase": "Running", "podIPs": [{"ip": ip}]}
    await create_pod_no_node_runs(env, pod)


def config(env: Env, tmp: Path, timeout: float, **hold: Any) -> GatewayConfig:
    """Engine pods found by selector (none yet: scaled to zero); the model is known from the
    config, as the operator renders it, so the gateway knows what it waits for."""
    budget = Limits(token_budget=TokenBudget(tokens=10_000, period=Duration(86400)))
    pods = KubernetesBackends(
        namespace=env.ns, selector=ENGINE_SELECTOR, port=ENGINE_PORT, kubeconfig=str(env.kubeconfig)
    )
    cfg = gateway_config(
        kubernetes=pods,
        keys=keys(tmp),
        hold=Hold(timeout=Duration(timeout), **hold),
        defaults=budget,
    )
    return dataclasses.replace(cfg, models=(ModelConfig(name="llama-3.1-8b"),))


async def test_held_until_a_replica_appears(
    sim_server: Any, gateway_server: Any, local_cluster: Env, tmp_path: Path
) -> None:
    engine = await sim_server(host="127.0.0.2", port=ENGINE_PORT)
    cfg = config(local_cluster, tmp_path, timeout=30)
    gw, scrape = await gateway_server(cfg), metrics_url(cfg)
    try:
        waiting = [asyncio.create_task(post(gw)) for _ in range(3)]
        assert await until(lambda: held(scrape), what="held requests exported") == 3
        # The autoscaler's replica arrives: Ready, labelled active.
        await replica_arrives(local_cluster, "e", "127.0.0.2")
        results = await asyncio.gather(*waiting)
        assert [r[0] for r in results] == [200, 200, 200], engine
        assert await held(scrape) == 0
    finally:
        await gateway_server.stop(gw)  # its watch ends before its namespace goes


async def test_a_request_waits_for_a_new_prefill_engine(
    sim_processes: Any, gateway_server: Any, local_cluster: Env, tmp_path: Path
) -> None:
    """Disaggregated serving whose prefill pool has no engine the gateway has checked yet (a
    rollout replaced them, or the pool scales from zero): the request is held as it is for
    the decode pool, and served once a prefill engine is Ready — not refused at once with
    503 (seen when a flood arrived between a new prefill pod's discovery and its first
    health check)."""
    bootstrap = free_port()
    prefill = sim_processes(
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap)
    )
    decode = sim_processes("--disaggregation-mode", "decode")
    labels = {"kvfleet.dev/inferenceservice": "llama", "app.kubernetes.io/component": "prefill"}
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    pods = KubernetesBackends(
        namespace=local_cluster.ns,
        selector=selector,
        port=int(prefill.rsplit(":", 1)[1]),
        kubeconfig=str(local_cluster.kubeconfig),
    )
    cfg = gateway_config(
        [decode],
        keys=keys(tmp_path),
        hold=Hold(timeout=Duration(30)),
        prefill=PrefillBackends(kubernetes=pods, bootstrap_port=bootstrap),
    )
    gw, scrape = await gateway_server(cfg), metrics_url(cfg)
    try:
        waiting = asyncio.create_task(post(gw))
        assert await until(lambda: held(scrape), what="the request held") == 1
        await replica_arrives(local_cluster, "p", "127.0.0.1", labels)
        status, _, body = await waiting
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        assert await held(scrape) == 0
    finally:
        await gateway_server.stop(gw)


async def test_deadline_gives_503_no_capacity_and_bills_nothing(
    gateway_server: Any, local_cluster: Env, tmp_path: Path
) -> None:
    gw_url = await gateway_server(config(local_cluster, tmp_path, 0.6))
    gw2 = await gateway_server(config(local_cluster, tmp_path, 30, max_requests=0))
    try:
        status, headers, body = await post(gw_url)
        assert status == 503 and body["error"]["code"] == "no_capacity"
        assert headers["Retry-After"] == "1"
        state = gateway_server.state(gw_url)
        limits = state.config.limits_for("t")
        assert await budget_in_use(state.store, "t", limits, time.time()) == 0
        # A full hold queue refuses at once.
        status, _, body = await asyncio.wait_for(post(gw2), 2)
        assert status == 503 and "already wait" in body["error"]["message"]
    finally:
        await gateway_server.stop(gw_url)
        await gateway_server.stop(gw2)


async def test_broken_replicas_fail_fast_instead_of_holding(
    gateway_server: Any, tmp_path: Path
) -> None:
    """Replicas that exist but fail are an outage: 503 at once, not a wait."""
    cfg = gateway_config([f"http://127.0.0.1:{free_port()}"], keys(tmp_path), hold=Hold())
    gw = await gateway_server(dataclasses.replace(cfg, models=(ModelConfig(name="llama-3.1-8b"),)))
    status, _, body = await asyncio.wait_for(post(gw), 5)
    assert status == 503 and body["error"]["code"] == "upstream_unavailable"


async def test_a_request_whose_replica_is_leaving_waits_for_the_new_one(
    sim_processes: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """A rollout: the only replica the gateway has checked refuses the request (it is
    shutting down) and the replica replacing it is discovered but not checked yet. The
    request is held for the new one, not failed with 502 after one try (seen in CI: a flood
    right after a prefill rollout got 502 'no prefill engine is available')."""
    from aiohttp import web

    from tests.support.fake_engine import fake_engine

    async def shutting_down(request: web.Request, body: dict[str, Any]) -> web.Response:
        return web.Response(status=503, text="the server is shutting down")

    new = sim_processes()
    async with fake_engine(shutting_down) as leaving:
        cfg = gateway_config([leaving.url], keys=keys(tmp_path), health_interval=60.0)
        gw = await gateway_server(cfg)
        backends = gateway_server.pool(gw).backends
        backends.set_members([leaving.url, new])  # discovered; its first check is a minute away

        async def first_check() -> None:
            await asyncio.sleep(0.5)
            async with aiohttp.ClientSession() as s:
                await backends.probe_all(s)

        checking = asyncio.create_task(first_check())
        status, _, body = await post(gw)
        await checking
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        assert len(leaving.bodies) == 1  # tried first, then held for the new replica
