"""Scale from zero at the gateway: with no replica to serve a model, requests are held (a
bounded queue with a deadline, exported as `kvfleet_gateway_held_requests`) until one
appears; past the deadline they get 503 `no_capacity` with Retry-After, and nothing is
billed."""

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
    Limits,
    ModelConfig,
    TokenBudget,
)
from kvfleet_gateway.keys import hash_key
from kvfleet_sim.procs import free_port
from tests.support.gateway import gateway_config
from tests.support.waiting import until

KEY = "kvf-hold-test"
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
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith("kvfleet_gateway_held_requests{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def config(engine: str, tmp: Path, timeout: float, **hold: Any) -> GatewayConfig:
    """One static engine that may not exist yet; the model is known from the config (as the
    operator renders it), so the gateway knows what it waits for."""
    budget = Limits(token_budget=TokenBudget(tokens=10_000, period=Duration(86400)))
    cfg = gateway_config(
        [engine], keys(tmp), hold=Hold(timeout=Duration(timeout), **hold), defaults=budget
    )
    return dataclasses.replace(cfg, models=(ModelConfig(name="llama-3.1-8b"),))


async def test_held_until_a_replica_appears(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    port = free_port()
    gw = await gateway_server(config(f"http://127.0.0.1:{port}", tmp_path, timeout=30))
    waiting = [asyncio.create_task(post(gw)) for _ in range(3)]
    assert await until(lambda: held(gw), what="held requests exported") == 3
    await sim_server(port=port)  # the autoscaler's replica arrives
    results = await asyncio.gather(*waiting)
    assert [r[0] for r in results] == [200, 200, 200]
    assert await held(gw) == 0


async def test_deadline_gives_503_no_capacity_and_bills_nothing(
    gateway_server: Any, tmp_path: Path
) -> None:
    gw_url = await gateway_server(config(f"http://127.0.0.1:{free_port()}", tmp_path, 0.6))
    status, headers, body = await post(gw_url)
    assert status == 503 and body["error"]["code"] == "no_capacity"
    assert headers["Retry-After"] == "1"
    state = gateway_server.state(gw_url)
    used = await state.store.budget_used(
        "t", state.config.limits_for("t"), time.time()
    )
    assert used == 0
    # A full hold queue refuses at once.
    gw2 = await gateway_server(
        config(f"http://127.0.0.1:{free_port()}", tmp_path, 30, max_requests=0)
    )
    status, _, body = await asyncio.wait_for(post(gw2), 2)
    assert status == 503 and "already wait" in body["error"]["message"]
