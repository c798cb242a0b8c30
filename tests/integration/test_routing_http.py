"""Routing in the running gateway: scraped engine signals, prefix affinity, circuit breaking,
and draining, over real HTTP to simulator engines."""

import asyncio
import json
from typing import Any

import aiohttp

from kvfleet_gateway.config import GatewayConfig
from tests.support.gateway import gateway_config

SYSTEM = "You are a meticulous assistant for the kvfleet project. " * 20


def config(backends: list[str], **kw: Any) -> GatewayConfig:
    return gateway_config(backends, scrape_interval=0.2, **kw)


async def chat(url: str, question: str, max_tokens: int = 4) -> dict[str, Any]:
    body = {
        "model": "llama-3.1-8b",
        "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return json.loads(await r.read())  # type: ignore[no-any-return]


async def test_gateway_scrapes_engine_signals(sim_server: Any, gateway_server: Any) -> None:
    engine = await sim_server()
    gw = await gateway_server(config([engine]))
    state = gateway_server.pool(gw)
    for _ in range(50):
        signals = state.backends.backends[engine].signals
        if signals is not None:
            break
        await asyncio.sleep(0.05)
    assert signals is not None
    assert signals.max_total_tokens > 400_000 and signals.queue_reqs == 0


async def test_shared_prefix_lands_where_it_is_cached(sim_server: Any, gateway_server: Any) -> None:
    engines = [await sim_server() for _ in range(3)]
    gw = await gateway_server(config(engines))  # default policy: kvfleet
    await asyncio.sleep(0.3)
    first = await chat(gw, "first question")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for i in range(6):
        answer = await chat(gw, f"question number {i}")
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0.8 * answer["usage"]["prompt_tokens"]  # the system prompt hit


async def test_dead_replica_opens_its_breaker_and_requests_still_succeed(
    sim_server: Any, gateway_server: Any
) -> None:
    live = await sim_server()
    dead = "http://127.0.0.1:9"  # nothing listens: connection refused
    # round robin keeps offering the dead replica; kvfleet would stick to the live one
    gw = await gateway_server(config([live, dead], health_interval=30, policy="round_robin"))
    state = gateway_server.pool(gw)
    state.backends.backends[dead].healthy = True  # pretend it passed its last health check
    for i in range(8):
        await chat(gw, f"q{i}")
    assert state.backends.backends[dead].breaker.state == "open"
    assert state.backends.backends[live].breaker.state == "closed"


async def test_removed_replica_drains(sim_server: Any, gateway_server: Any) -> None:
    a, b = await sim_server(time_scale=3.0), await sim_server(time_scale=3.0)
    gw = await gateway_server(config([a, b], policy="round_robin"))
    state = gateway_server.pool(gw)
    await asyncio.sleep(0.3)
    slow = asyncio.create_task(chat(gw, "long answer", max_tokens=40))
    await asyncio.sleep(0.2)
    busy = next(u for u, be in state.backends.backends.items() if be.inflight_requests)
    keep = b if busy == a else a
    state.backends.set_members([keep])
    assert state.backends.backends[busy].draining  # still there while its request runs
    assert [be.url for be in state.backends.routable()] == [keep]
    await chat(gw, "new one")
    assert (await slow)["usage"]["completion_tokens"] > 0  # the in-flight one finished
    state.backends.forget_drained()
    assert busy not in state.backends.backends


async def test_slow_probes_eject_a_replica_only_three_in_a_row(
    gateway_server: Any,
) -> None:
    """Health probes fail three times in a row before a replica is ejected: a busy engine
    may answer slowly. (A refused connection ejects at once: test_gateway's killed engine.)"""
    from aiohttp import web

    from kvfleet_sim.procs import free_port

    slow = asyncio.Event()

    async def health(request: web.Request) -> web.Response:
        if slow.is_set():
            await asyncio.sleep(5)
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "llama-3.1-8b", "max_model_len": 8192}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        gw = await gateway_server(config([url], health_interval=0.2))
        backend = gateway_server.pool(gw).backends.backends[url]
        for _ in range(50):
            if backend.healthy:
                break
            await asyncio.sleep(0.05)
        assert backend.healthy
        slow.set()
        for _ in range(40):  # each probe times out after 0.4 s
            if backend.probe_failures >= 1:
                break
            await asyncio.sleep(0.05)
        assert backend.probe_failures >= 1 and backend.healthy  # one slow probe: still in
        for _ in range(60):
            if not backend.healthy:
                break
            await asyncio.sleep(0.05)
        assert not backend.healthy and backend.probe_failures >= 3
    finally:
        await runner.cleanup()


async def test_streamed_answers_report_their_timing_to_the_policy(
    sim_server: Any, gateway_server: Any
) -> None:
    """The gateway times each streamed answer from dispatch to its first token and between
    tokens, for the policy's calibration; a whole (non-streamed) answer says nothing."""
    engine = await sim_server()
    gw = await gateway_server(config([engine]))
    policy = gateway_server.pool(gw).policy
    seen: list[tuple[float, float | None]] = []
    observe = policy.observe

    def spy(req: Any, key: str, ttft_s: float, itl_s: float | None) -> None:
        seen.append((ttft_s, itl_s))
        observe(req, key, ttft_s, itl_s)

    policy.observe = spy
    await asyncio.sleep(0.3)
    await chat(gw, "not streamed", max_tokens=8)
    body = {
        "model": "llama-3.1-8b",
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
    }
    async with aiohttp.ClientSession() as s, s.post(f"{gw}/v1/chat/completions", json=body) as r:
        assert r.status == 200
        await r.read()
    ((ttft, itl),) = seen
    assert 0 < ttft < 1 and itl is not None and 0 < itl < ttft
    assert policy.step_scale != 1.0  # the decode step learned (the prompt hit the cache: its
    assert policy.prefill_rate == policy.priors.prefill_tokens_per_second  # TTFT: no prefill)
