"""The gateway over real HTTP in front of simulator engines, with the real OpenAI SDK."""

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from kvfleet_gateway.app import make_app
from kvfleet_gateway.config import (
    Backends,
    ConfigError,
    CostConfig,
    Duration,
    GatewayConfig,
    Limits,
    Timeouts,
    TokenBudget,
)
from kvfleet_gateway.keys import hash_key
from kvfleet_sim.faults import FaultPlan
from tests.support.gateway import budget_in_use, gateway_config, metrics_url
from tests.support.waiting import until

KEY_A, KEY_B = "kvf-test-key-a", "kvf-test-key-b"


def keys_file(tmp_path: Path, tenants: list[dict[str, Any]] | None = None) -> Path:
    f = tmp_path / "keys.yaml"
    doc = {
        "tenants": tenants
        or [
            {"name": "team-a", "keys": [hash_key(KEY_A)]},
            {"name": "team-b", "keys": [hash_key(KEY_B)], "limits": {"requestsPerMinute": 2}},
        ]
    }
    f.write_text(json.dumps(doc))
    return f


def config(backends: list[str], keys: Path | None, **kw: Any) -> GatewayConfig:
    return gateway_config(backends, keys, **kw)


async def call(
    url: str, path: str, body: Any, key: str | None = KEY_A, raw: bytes | None = None
) -> tuple[int, dict[str, str], Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + path, data=raw if raw is not None else json.dumps(body), headers=headers) as r,
    ):
        text = await r.read()
        try:
            return r.status, dict(r.headers), json.loads(text)
        except ValueError:
            return r.status, dict(r.headers), text.decode()


CHAT = {
    "model": "llama-3.1-8b",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 8,
}


async def test_refuses_to_start_without_keys() -> None:
    with pytest.raises(ValueError, match="insecure-no-auth"):
        make_app(GatewayConfig(backends=Backends(static=("http://127.0.0.1:1",))))


async def test_auth_and_openai_sdk_end_to_end(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    engine = await sim_server()
    gw = await gateway_server(config([engine], keys_file(tmp_path)))
    status, _, body = await call(gw, "/v1/chat/completions", CHAT, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _, body = await call(gw, "/v1/chat/completions", CHAT, key="wrong")
    assert status == 401 and "invalid API key" in body["error"]["message"]

    client = openai.AsyncOpenAI(base_url=f"{gw}/v1", api_key=KEY_A, max_retries=0)
    try:
        chat = await client.chat.completions.create(**CHAT)  # type: ignore[call-overload]
        assert chat.usage.completion_tokens == 8
        stream = await client.chat.completions.create(**CHAT, stream=True)  # type: ignore[call-overload]
        chunks = [c async for c in stream]
        assert all(c.usage is None for c in chunks)  # usage chunk stripped: not asked for
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == chat.choices[0].message.content
        stream = await client.chat.completions.create(
            **CHAT, stream=True, stream_options={"include_usage": True}
        )  # type: ignore[call-overload]
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        models = await client.models.list()
        assert [m.id for m in models.data] == ["llama-3.1-8b"]
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-9", messages=CHAT["messages"])
    finally:
        await client.close()


async def test_generate_passthrough_and_access_log(
    sim_server: Any, gateway_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await sim_server()
    gw = await gateway_server(config([engine], None))
    with caplog.at_level("INFO", logger="kvfleet.gateway.access"):
        status, _, body = await call(
            gw, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}}
        )
    assert status == 200 and body["meta_info"]["completion_tokens"] == 4
    line = json.loads(caplog.records[-1].getMessage())
    assert line["tenant"] == "anonymous" and line["completion_tokens"] == 4
    assert line["backend"] == engine and line["ttft_s"] > 0 and line["usage_reported"]


async def test_rate_limit_429_with_headers_and_retry_after(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    engine = await sim_server()
    gw = await gateway_server(config([engine], keys_file(tmp_path)))
    results = [await call(gw, "/v1/chat/completions", CHAT, key=KEY_B) for _ in range(3)]
    assert [r[0] for r in results] == [200, 200, 429]
    ok_headers, (_, headers, body) = results[0][1], results[2]
    assert ok_headers["x-ratelimit-limit-requests"] == "2"
    assert ok_headers["x-ratelimit-remaining-requests"] == "1"
    assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "requests"
    assert 55 <= int(headers["Retry-After"]) <= 60
    assert headers["x-ratelimit-remaining-requests"] == "0"
    # another tenant is unaffected
    assert (await call(gw, "/v1/chat/completions", CHAT, key=KEY_A))[0] == 200


async def test_stream_carries_rate_limit_headers(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    engine = await sim_server()
    cfg = config(
        [engine],
        keys_file(tmp_path),
        defaults=Limits(requests_per_minute=100, tokens_per_minute=100_000),
    )
    gw = await gateway_server(cfg)
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{gw}/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"Authorization": f"Bearer {KEY_A}"},
        ) as r,
    ):
        assert r.headers["x-ratelimit-limit-tokens"] == "100000"
        assert int(r.headers["x-ratelimit-remaining-tokens"]) < 100_000
        assert r.headers["x-ratelimit-remaining-requests"] == "99"
        await r.read()


async def test_budget_reserves_then_refunds_to_real_usage(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    engine = await sim_server()
    cfg = config(
        [engine],
        keys_file(tmp_path),
        defaults=Limits(token_budget=TokenBudget(tokens=2_000, period=Duration(86_400))),
    )
    gw = await gateway_server(cfg)
    # No max_tokens from the client and none configured: 1,024 are reserved, far fewer used.
    status, headers, body = await call(
        gw, "/v1/chat/completions", {"model": "llama-3.1-8b", "messages": CHAT["messages"]}
    )
    assert status == 200
    used = body["usage"]["total_tokens"]
    # At admission: nothing settled yet, this request's reservation reported apart.
    assert int(headers["x-kvfleet-budget-remaining-tokens"]) == 2_000
    assert int(headers["x-kvfleet-budget-reserved-tokens"]) > 1_024
    assert int(headers["x-kvfleet-budget-resets-at"]) == (time.time() // 86_400 + 1) * 86_400
    store = gateway_server.state(gw).store
    assert await budget_in_use(store, "team-a", cfg.limits.defaults, time.time()) == used
    # A request that fits the budget but not what is left: insufficient_quota until the reset.
    over = 2_000 - used - 16 + 1  # 16 = the gateway's estimate for this prompt
    status, headers, body = await call(gw, "/v1/chat/completions", {**CHAT, "max_tokens": over})
    assert status == 429 and body["error"]["code"] == "insufficient_quota"
    assert 0 < int(headers["Retry-After"]) <= 86_400
    # Larger than the whole budget: refused, and no Retry-After (waiting cannot help).
    status, headers, body = await call(gw, "/v1/chat/completions", {**CHAT, "max_tokens": 1999})
    assert status == 429 and "Retry-After" not in headers


@pytest.mark.parametrize(
    ("body", "raw", "status", "fragment"),
    [
        (None, b"{oops", 400, "not valid JSON"),
        ({"model": "llama-3.1-8b"}, None, 400, "'messages'"),
        ({**CHAT, "max_tokens": 0}, None, 400, "at least 1"),
        ({**CHAT, "max_tokens": "x"}, None, 400, "integer"),
        ({**CHAT, "n": 3}, None, 400, "n=1"),
        ({**CHAT, "max_tokens": 10**7}, None, 400, "context"),
        ({**CHAT, "stream_options": {"include_usage": True}}, None, 400, "stream: true"),
        ({**CHAT, "messages": [{"content": "x"}]}, None, 400, "role"),
        (None, b"x" * (70 * 1024), 413, "larger than"),
    ],
)
async def test_bad_input_is_refused_and_nothing_is_charged(
    sim_server: Any,
    gateway_server: Any,
    tmp_path: Path,
    body: Any,
    raw: bytes | None,
    status: int,
    fragment: str,
) -> None:
    engine = await sim_server()
    cfg = config(
        [engine],
        keys_file(tmp_path),
        max_body_bytes=64 * 1024,
        defaults=Limits(token_budget=TokenBudget(tokens=100_000, period=Duration(86_400))),
    )
    gw = await gateway_server(cfg)
    got, _, err = await call(gw, "/v1/chat/completions", body, raw=raw)
    assert got == status
    assert fragment in err["error"]["message"]
    assert set(err["error"]) == {"message", "type", "param", "code"}
    store = gateway_server.state(gw).store
    assert await budget_in_use(store, "team-a", cfg.limits.defaults, time.time()) == 0
    assert (await call(gw, "/v1/chat/completions", CHAT))[0] == 200  # still serving


async def test_max_tokens_cap_and_injected_default(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    engine = await sim_server(simulate_eos=False)
    cfg = config(
        [engine], keys_file(tmp_path), defaults=Limits(max_tokens=64, default_max_tokens=16)
    )
    gw = await gateway_server(cfg)
    status, _, body = await call(gw, "/v1/chat/completions", {**CHAT, "max_tokens": 65})
    assert status == 400 and "limit of 64" in body["error"]["message"]
    _, _, body = await call(gw, "/v1/completions", {"model": "llama-3.1-8b", "prompt": "x"})
    assert body["usage"]["completion_tokens"] == 16  # the injected default, not the engine's


async def test_keys_file_reload_and_broken_file_keeps_old_keys(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    engine = await sim_server()
    kf = keys_file(tmp_path)
    gw = await gateway_server(config([engine], kf))
    new_key = "kvf-rotated"
    kf.write_text(json.dumps({"tenants": [{"name": "team-a", "keys": [hash_key(new_key)]}]}))
    for _ in range(40):
        if (await call(gw, "/v1/chat/completions", CHAT, key=new_key))[0] == 200:
            break
        await asyncio.sleep(0.1)
    assert (await call(gw, "/v1/chat/completions", CHAT, key=new_key))[0] == 200
    assert (await call(gw, "/v1/chat/completions", CHAT, key=KEY_A))[0] == 401
    kf.write_text("tenants: [{name: x, keys: [not-a-hash]}]")
    await asyncio.sleep(1.5)
    assert (await call(gw, "/v1/chat/completions", CHAT, key=new_key))[0] == 200


async def test_retry_before_first_byte_on_another_replica(
    sim_server: Any, gateway_server: Any
) -> None:
    bad = await sim_server(faults=FaultPlan(fail_nth=1))
    good = await sim_server()
    gw = await gateway_server(config([bad, good], None))
    statuses = [(await call(gw, "/v1/chat/completions", CHAT))[0] for _ in range(4)]
    assert statuses == [200] * 4


async def test_engine_dying_mid_stream_ends_with_error_event_and_settles(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    engine = await sim_server(faults=FaultPlan(drop_nth=1, drop_after_chunks=3))
    cfg = config(
        [engine],
        keys_file(tmp_path),
        defaults=Limits(
            max_concurrent=5, token_budget=TokenBudget(tokens=10**6, period=Duration(86400))
        ),
    )
    gw = await gateway_server(cfg)
    client = openai.AsyncOpenAI(base_url=f"{gw}/v1", api_key=KEY_A, max_retries=0)
    try:
        stream = await client.chat.completions.create(**{**CHAT, "max_tokens": 50}, stream=True)  # type: ignore[call-overload]
        with pytest.raises(openai.APIError, match="mid-stream"):
            async for _ in stream:
                pass
    finally:
        await client.close()
    store = gateway_server.state(gw).store
    now = time.time()
    await asyncio.sleep(0.1)
    assert await store.active_leases("team-a", now) == 0
    assert 0 < await budget_in_use(store, "team-a", cfg.limits.defaults, now) < 1050


async def test_a_gateway_stays_ready_until_it_has_checked_its_new_replicas(
    gateway_server: Any,
) -> None:
    """Every replica replaced (a rollout, or discovery's first list): until its first health
    check of the new ones the gateway holds requests for them, so it stays ready — turning
    unready there dropped it from its Service just after its InferenceService said Ready.
    Once checked and failing, it is an outage: not ready."""
    from kvfleet_sim.procs import free_port

    gw = await gateway_server(config(["http://127.0.0.1:9"], None, health_interval=60.0))
    backends = gateway_server.pool(gw).backends

    async def ready() -> int:
        async with aiohttp.ClientSession() as s, s.get(f"{gw}/readyz") as r:
            return r.status

    assert await ready() == 503  # probed at start: nothing answers
    backends.set_members([f"http://127.0.0.1:{free_port()}"])  # all new, not yet checked
    assert await ready() == 200
    async with aiohttp.ClientSession() as session:
        await backends.probe_all(session)
    assert await ready() == 503


async def test_readyz_and_metrics(sim_server: Any, gateway_server: Any, tmp_path: Path) -> None:
    gw_down = await gateway_server(config(["http://127.0.0.1:9"], None))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{gw_down}/readyz") as r:
            assert r.status == 503
        async with s.get(f"{gw_down}/healthz") as r:
            assert r.status == 200
    engine = await sim_server()
    cfg = config([engine], keys_file(tmp_path))
    cfg = dataclasses.replace(cfg, cost=CostConfig(gpu_hourly_price=3.6))
    gw = await gateway_server(cfg)
    await call(gw, "/v1/chat/completions", {**CHAT, "stream": True})
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{gw}/metrics") as r:  # not on the clients' port
            assert r.status == 404
        async with s.get(metrics_url(cfg)) as r:
            text = await r.text()
    assert (
        'kvfleet_gateway_requests_total{model="llama-3.1-8b",status="200",tenant="team-a"} 1.0'
        in text
    )
    assert (
        "kvfleet_gateway_time_to_first_token_seconds_count"
        '{model="llama-3.1-8b",tenant="team-a"} 1.0' in text
    )
    assert (
        'kvfleet_gateway_tokens_total{kind="completion",model="llama-3.1-8b",tenant="team-a"} 8.0'
        in text
    )
    assert "kvfleet_gateway_request_gpu_seconds_count" in text
    cost = [line for line in text.splitlines() if line.startswith("kvfleet_gateway_cost_total")]
    assert cost and float(cost[0].split()[-1]) > 0
    assert KEY_A not in text and hash_key(KEY_A) not in text


async def test_slow_client_body_gets_408_and_nothing_is_charged(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    engine = await sim_server()
    cfg = config([engine], keys_file(tmp_path))
    cfg = dataclasses.replace(cfg, timeouts=Timeouts(client_body=Duration(0.3)))
    gw = await gateway_server(cfg)
    host, port = gw.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer " + KEY_A.encode() + b"\r\n"
        b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"mod'
    )
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), timeout=5)
    writer.close()
    await writer.wait_closed()
    assert b" 408 " in status_line
    assert (await call(gw, "/v1/chat/completions", CHAT))[0] == 200


async def test_a_cancelled_handler_counts_as_a_client_disconnect(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """Whether the stream sees a reset or its handler is cancelled, the request is a 499."""
    engine = await sim_server(time_scale=2.0)
    gw = await gateway_server(config([engine], keys_file(tmp_path)))
    state, pool = gateway_server.state(gw), gateway_server.pool(gw)
    handlers: list[asyncio.Task[Any]] = []
    original = pool.proxy.forward

    async def tracked(*args: Any) -> Any:
        task = asyncio.current_task()
        assert task is not None
        handlers.append(task)
        return await original(*args)

    pool.proxy.forward = tracked
    body = {**CHAT, "max_tokens": 500, "stream": True, "ignore_eos": True}
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{gw}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        ) as r,
    ):
        await r.content.readuntil(b"\n\n")
        handlers[0].cancel()  # what aiohttp does to a handler whose client went away
        for _ in range(50):
            if state.metrics.requests.labels("team-a", "llama-3.1-8b", "499")._value.get():
                break
            await asyncio.sleep(0.02)
    assert state.metrics.requests.labels("team-a", "llama-3.1-8b", "499")._value.get() == 1
    assert state.metrics.requests.labels("team-a", "llama-3.1-8b", "200")._value.get() == 0
    assert await state.store.active_leases("team-a", time.time()) == 0


async def test_a_keyed_engine_serves_only_a_gateway_that_presents_its_key(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """An engine started with --api-key answers /health and /metrics to anyone (probes and
    scrapers, as SGLang does) and its API only with the key; the gateway presents the key
    from `backends.engineApiKeyFile` on every call (probes, signals, requests), and its own
    clients never see or send it."""
    engine = await sim_server(api_key="engine-secret-1")
    async with aiohttp.ClientSession() as s:
        for path in ("/health", "/metrics", "/health_generate"):
            async with s.get(engine + path) as r:
                assert r.status == 200, path
        async with s.post(engine + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 401
        async with s.get(engine + "/v1/models", headers={"Authorization": "bearer x"}) as r:
            assert r.status == 401
    key_file = tmp_path / "engine-key"
    key_file.write_text("engine-secret-1\n")  # a mounted Secret's file may end in a newline
    base = config([engine], keys_file(tmp_path))
    keyed = dataclasses.replace(
        base, backends=dataclasses.replace(base.backends, engine_api_key_file=str(key_file))
    )
    gw = await gateway_server(keyed)
    status, _, body = await call(gw, "/v1/chat/completions", CHAT)
    assert status == 200 and body["usage"]["completion_tokens"] == 8
    status, _, body = await call(gw, "/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200 and "data: [DONE]" in body
    # Without the key the engine is probed unhealthy (its /health answers, its API does
    # not) and the client hears that no engine replica is available, never a 401 that
    # would look like its own key's fault.
    unkeyed = await gateway_server(config([engine], keys_file(tmp_path)))
    pool = gateway_server.pool(unkeyed).backends
    await until(lambda: pool.backends[engine].probed, what="a probe")
    status, _, body = await call(unkeyed, "/v1/chat/completions", CHAT)
    assert status == 503 and "no engine replica is available" in body["error"]["message"]
    bad = tmp_path / "bad-key"
    bad.write_text("two words\n")
    with pytest.raises(ConfigError, match="engineApiKeyFile"):
        make_app(dataclasses.replace(
            base, backends=dataclasses.replace(base.backends, engine_api_key_file=str(bad))
        ))  # fmt: skip
