"""Fair sharing under overload, over real HTTP against the simulator: when every replica is
saturated the gateway queues requests and lets them out in fair order (VTC), critical before
standard, sheddable refused with 503 and Retry-After, a full queue and a passed deadline
refused too, nothing billed for any of them; the queue and the refusals are metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvfleet_gateway.config import Duration, Fairness
from kvfleet_gateway.keys import hash_key
from tests.support.gateway import gateway_config, metrics_url
from tests.support.waiting import until

TENANTS = {
    "flood": {},
    "steady": {},
    "urgent": {"priority": "critical"},
    "batch": {"priority": "sheddable"},
}


def keys_file(tmp: Path) -> Path:
    tenants = [{"name": n, "keys": [hash_key(f"kvf-{n}")], "limits": limits}
               for n, limits in TENANTS.items()]  # fmt: skip
    path = tmp / "keys.yaml"
    path.write_text(json.dumps({"tenants": tenants}))
    return path


async def gateway(sim_server: Any, gateway_server: Any, tmp: Path, **fairness: Any) -> str:
    """One simulated engine taking one request at a time from the gateway (unless told)."""
    engine = await sim_server()
    config = gateway_config([engine], keys_file(tmp))
    settings = {"enabled": True, "max_inflight_per_replica": 1, "reserve_per_replica": 0,
                **fairness}  # fmt: skip
    return str(await gateway_server(dataclasses.replace(config, fairness=Fairness(**settings))))


async def chat(s: aiohttp.ClientSession, url: str, tenant: str, tokens: int = 30) -> dict[str, Any]:
    """A streamed chat of `tokens` tokens: its status, headers, time to first token and end."""
    body = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": tokens, "ignore_eos": True, "stream": True}  # fmt: skip
    start = time.monotonic()
    first = None
    async with s.post(f"{url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer kvf-{tenant}"}) as r:  # fmt: skip
        text = b""
        async for chunk in r.content.iter_any():
            first = first or time.monotonic()
            text += chunk
        return {"status": r.status, "headers": dict(r.headers), "first": (first or 0) - start,
                "end": time.monotonic(), "body": text.decode()}  # fmt: skip


async def metric(url: str, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_a_tenant_that_arrives_behind_a_flood_goes_next(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """Six requests of one tenant fill the pool (one runs, five wait); a second tenant's one
    request, arriving after them, is the next to run: its service so far is the least. First
    come first served would put it last."""
    url = await gateway(sim_server, gateway_server, tmp_path)
    async with aiohttp.ClientSession() as s:
        floods = [asyncio.create_task(chat(s, url, "flood")) for _ in range(6)]
        queued = metrics_url_of(url, gateway_server)
        await until(lambda: metric(queued, "kvfleet_gateway_queued_requests"), 10, "a queue")
        steady = await chat(s, url, "steady")
        flood = await asyncio.gather(*floods)
    assert steady["status"] == 200 and all(f["status"] == 200 for f in flood)
    ended_before = sum(f["end"] < steady["end"] for f in flood)
    assert ended_before == 1, [round(f["end"] - steady["end"], 2) for f in flood]
    service = await metric(queued, "kvfleet_gateway_fair_share_service", tenant="flood")
    assert service > await metric(queued, "kvfleet_gateway_fair_share_service", tenant="steady")


async def test_a_reserved_slot_lets_a_tenant_under_its_share_start_at_once(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """Two slots, one reserved: a flood fills one and waits for it; a steady tenant's
    request takes the reserved slot at once and ends while the flood's first still runs."""
    url = await gateway(sim_server, gateway_server, tmp_path, max_inflight_per_replica=2,
                        reserve_per_replica=1)  # fmt: skip
    metrics = metrics_url_of(url, gateway_server)
    async with aiohttp.ClientSession() as s:
        floods = [asyncio.create_task(chat(s, url, "flood", tokens=120)) for _ in range(3)]
        await until(lambda: metric(metrics, "kvfleet_gateway_queued_requests"), 10, "a queue")
        steady = await chat(s, url, "steady", tokens=10)
        flood = await asyncio.gather(*floods)
    assert sum(f["end"] < steady["end"] for f in flood) == 0
    assert steady["first"] < min(f["first"] for f in flood[1:])


def metrics_url_of(url: str, servers: Any) -> str:
    return metrics_url(servers.state(url).config)


async def test_critical_goes_first_and_sheddable_is_refused_unbilled(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    url = await gateway(sim_server, gateway_server, tmp_path)
    metrics = metrics_url_of(url, gateway_server)
    async with aiohttp.ClientSession() as s:
        # Not saturated: a sheddable request is served like any other.
        assert (await chat(s, url, "batch", tokens=2))["status"] == 200
        floods = [asyncio.create_task(chat(s, url, "flood")) for _ in range(4)]
        await until(lambda: metric(metrics, "kvfleet_gateway_queued_requests"), 10, "a queue")
        shed = await chat(s, url, "batch")
        urgent = await chat(s, url, "urgent")
        flood = await asyncio.gather(*floods)
    assert shed["status"] == 503 and int(shed["headers"]["Retry-After"]) >= 1
    assert json.loads(shed["body"])["error"]["code"] == "overloaded"
    assert await metric(metrics, "kvfleet_gateway_shed_requests_total", reason="sheddable") == 1
    # Nothing billed for the refused request: the tokens counted are the first one's only.
    billed = await metric(metrics, "kvfleet_gateway_tokens_total", tenant="batch",
                          kind="completion")  # fmt: skip
    assert billed == 2
    assert urgent["status"] == 200
    assert sum(f["end"] < urgent["end"] for f in flood) == 1  # the running one only


async def test_a_full_queue_refuses_the_tenant_holding_it_and_a_deadline_passes(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """A queue of two, full of a flooding tenant's requests: its next one is refused; a
    steady tenant's displaces the flood's newest; the rest wait out their 0.5 s deadline.
    Every refusal is a 503 with Retry-After and nothing billed."""
    url = await gateway(sim_server, gateway_server, tmp_path, max_waiting=2,
                        timeout=Duration(0.5))  # fmt: skip
    metrics = metrics_url_of(url, gateway_server)
    async with aiohttp.ClientSession() as s:
        long = asyncio.create_task(chat(s, url, "flood", tokens=200))  # ~1.5 s: runs
        await asyncio.sleep(0.1)
        waiting = [asyncio.create_task(chat(s, url, "flood")) for _ in range(2)]

        async def two_wait() -> bool:
            return await metric(metrics, "kvfleet_gateway_queued_requests") == 2

        await until(two_wait, 10, "two waiting")
        full = await chat(s, url, "flood")
        steady = await chat(s, url, "steady")
        flood = await asyncio.gather(*waiting)
        assert (await long)["status"] == 200

    def message(r: dict[str, Any]) -> str:
        assert r["status"] == 503 and int(r["headers"]["Retry-After"]) >= 1
        return str(json.loads(r["body"])["error"]["message"])

    assert "already wait" in message(full)
    assert "stayed overloaded for 0.5s" in message(steady)
    said = sorted(message(r) for r in flood)
    assert "your tenant holds the most of it" in said[0] and "stayed overloaded" in said[1]
    for reason, n in (("queue_full", 1), ("displaced", 1), ("timeout", 2)):
        assert await metric(metrics, "kvfleet_gateway_shed_requests_total", reason=reason) == n
    assert await metric(metrics, "kvfleet_gateway_queued_requests") == 0
    assert await metric(metrics, "kvfleet_gateway_tokens_total", tenant="steady") == 0
