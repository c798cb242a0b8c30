"""Prefill/decode disaggregation through real HTTP: simulator engines in SGLang's PD modes
(`--disaggregation-mode prefill|decode`), the kvfleet gateway pairing them with SGLang's
bootstrap fields, and the real sglang-router in PD mode driving the same engines."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from kvfleet_gateway.config import Duration, Limits, PrefillBackends, PrefillEngine, TokenBudget
from kvfleet_sim.procs import free_port, sglang_router_process
from tests.integration.test_gateway import KEY_A, keys_file
from tests.support.gateway import budget_in_use, gateway_config, metrics_url, upstream_errors
from tests.support.metrics import scraped_sync

CHAT = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hello there"}]}


def _prefill(sims: Any, *extra: str) -> tuple[str, int]:
    port = free_port()
    url = sims("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port),
               *extra)  # fmt: skip
    return url, port


def _counter(url: str, name: str) -> float:
    return scraped_sync(f"{url}/metrics", f"sglang:{name}")


async def _gateway_errors(config: Any) -> dict[str, float]:
    return await upstream_errors(metrics_url(config))


async def test_the_gateway_pairs_prefill_and_decode_engines(
    sim_processes: Any, gateway_server: Any
) -> None:
    (p1, port1), (p2, port2) = _prefill(sim_processes), _prefill(sim_processes)
    decode = sim_processes("--disaggregation-mode", "decode")
    # (On one host each prefill engine has its own bootstrap port; pods share one.)
    engines = (
        PrefillEngine(url=p1, bootstrap_port=port1),
        PrefillEngine(url=p2, bootstrap_port=port2),
    )
    config = gateway_config([decode], prefill=PrefillBackends(static=engines))
    url = await gateway_server(config)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            **CHAT, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )  # type: ignore[call-overload]
        pieces, usage = [], None
        async for chunk in stream:
            pieces += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == 6 and "".join(pieces)
        whole = await client.chat.completions.create(**CHAT, max_tokens=4)  # type: ignore[call-overload]
        assert whole.usage is not None and whole.usage.completion_tokens == 4
        # The prompt's prefix is cached on the prefill engine: the second answer says so.
        assert whole.usage.prompt_tokens_details is not None
        assert whole.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        await client.close()
    # The prefill engines computed the prompts (one token each) — the same one both times,
    # which held the prefix; the decode engine decoded, from KV it was handed.
    assert sorted(_counter(p, "generation_tokens") for p in (p1, p2)) == [0, 2]
    assert _counter(decode, "generation_tokens") == 10
    assert _counter(decode, "prompt_tokens") == 0
    assert await _gateway_errors(config) == {}


async def test_a_prefill_engine_that_fails_is_replaced_before_decoding(
    sim_processes: Any, gateway_server: Any
) -> None:
    """The prefill engine refuses (500): the decode half is cancelled and the pair retried;
    the client sees one whole answer."""
    port = free_port()
    flaky = sim_processes("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                          str(port), "--fail-nth", "1")  # fmt: skip
    good, good_port = _prefill(sim_processes)
    decode = sim_processes("--disaggregation-mode", "decode")
    engines = (PrefillEngine(url=flaky, bootstrap_port=port),
               PrefillEngine(url=good, bootstrap_port=good_port))  # fmt: skip
    config = gateway_config([decode], prefill=PrefillBackends(static=engines), policy="round_robin")
    url = await gateway_server(config)
    async with aiohttp.ClientSession() as s:
        for _ in range(4):  # round robin: the flaky engine's first request is among them
            async with s.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 3}) as r:
                body = await r.json()
                assert r.status == 200, body
                assert body["usage"]["completion_tokens"] == 3
    assert await _gateway_errors(config) == {f'backend="{flaky}",kind="http_500"': 1.0}
    assert _counter(decode, "num_requests") == 4  # the cancelled half was never admitted


async def test_a_request_is_never_sent_to_half_a_pair(
    sim_processes: Any, gateway_server: Any
) -> None:
    """No prefill engine up: a 503 naming it, and the decode engine never saw the request."""
    decode = sim_processes("--disaggregation-mode", "decode")
    dead = f"http://127.0.0.1:{free_port()}"
    config = gateway_config([decode], prefill=PrefillBackends(static=(PrefillEngine(url=dead),)))
    url = await gateway_server(config)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{config.listen.metrics_port}/readyz") as r:
            assert r.status == 503 and (await r.json())["readyPrefill"] == 0
        async with s.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 3}) as r:
            body = await r.json()
    assert r.status in (502, 503), body
    assert "prefill engine" in body["error"]["message"], body
    assert _counter(decode, "num_requests") == 0


def test_a_decode_engine_refuses_requests_without_a_pair(sim_processes: Any) -> None:
    decode = sim_processes("--disaggregation-mode", "decode")
    req = urllib.request.Request(
        f"{decode}/v1/chat/completions",
        data=json.dumps({**CHAT, "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code == 400
    assert "bootstrap_room" in json.loads(refused.value.read())["message"]


def test_sglang_router_in_pd_mode_drives_the_simulator(sim_processes: Any, tmp_path: Path) -> None:
    """The peer: sglang-router 0.3.2 `--pd-disaggregation` in front of simulator engines
    speaks the same protocol (its bootstrap fields, the decode engine's answer)."""
    pytest.importorskip("sglang_router", reason="sglang-router is a dev dependency")
    prefill, port = _prefill(sim_processes)
    decode = sim_processes("--disaggregation-mode", "decode")
    with sglang_router_process([decode], tmp_path / "router.log", prefills=[(prefill, port)]) as r:
        req = urllib.request.Request(
            f"{r}/v1/chat/completions",
            data=json.dumps({**CHAT, "max_tokens": 5}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            body = json.loads(resp.read())
    assert body["usage"]["completion_tokens"] == 5
    assert (
        _counter(prefill, "generation_tokens") == 1 and _counter(decode, "generation_tokens") == 5
    )


async def test_a_decode_engine_lost_mid_stream_ends_the_stream_with_an_error(
    sim_processes: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """The decode engine dies after three chunks: the client's stream ends with an error
    event (not a hang, not a silent cut), with no retry — the answer had begun — and the
    tenant's budget is settled at what the engine reported, its lease released."""
    prefill, port = _prefill(sim_processes)
    decode = sim_processes("--disaggregation-mode", "decode", "--exit-after-chunks", "3")
    engines = (PrefillEngine(url=prefill, bootstrap_port=port),)
    budget = Limits(token_budget=TokenBudget(tokens=10**6, period=Duration(86400)))
    config = gateway_config([decode], keys_file(tmp_path), defaults=budget,
                            prefill=PrefillBackends(static=engines))  # fmt: skip
    url = await gateway_server(config)
    body = {**CHAT, "max_tokens": 50, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status == 200
        text = (await r.read()).decode()
    events = [e for e in text.split("\n\n") if e.startswith("data: ")]
    assert '"error"' in events[-1] and "[DONE]" not in events[-1], events[-2:]
    errors = await _gateway_errors(config)
    assert any(k.startswith(f'backend="{decode}"') for k in errors), errors
    store = gateway_server.state(url).store
    await asyncio.sleep(0.1)
    now = time.time()
    assert await store.active_leases("team-a", now) == 0
    # Billed the prompt and the few tokens streamed, not the 50-token reservation's bound.
    assert 0 < await budget_in_use(store, "team-a", budget, now) < 200


async def test_the_prefix_index_follows_the_prefill_pools_kv_events(
    sim_processes: Any, gateway_server: Any
) -> None:
    """prefixIndex: events in PD mode subscribes to the prefill engines — where prompts are
    computed and prefixes cached — not the decode engines (which keep no prefix cache): the
    stored pages of a prompt arrive from the prefill engine that computed it, and the same
    prompt again goes there and finds its prefix cached."""
    from dataclasses import replace

    from kvfleet_gateway.config import PrefixIndexConfig
    from tests.integration.test_kv_events import PAGE, TOKENIZER, engine_flags, prompt
    from tests.integration.test_kv_events import metric as read_metric
    from tests.support.waiting import until

    prefills = [_prefill(sim_processes, *engine_flags()) for _ in range(2)]
    decode = sim_processes("--disaggregation-mode", "decode", "--tokenizer-path", str(TOKENIZER))
    engines = tuple(PrefillEngine(url=u, bootstrap_port=p) for u, p in prefills)
    base = gateway_config([decode], prefill=PrefillBackends(static=engines))
    index = PrefixIndexConfig(source="events", tokenizer=str(TOKENIZER))
    config = replace(base, routing=replace(base.routing, prefix_index=index))
    url, metrics = await gateway_server(config), metrics_url(config)

    def gauge(name: str, **labels: str) -> float:
        return read_metric(metrics, name, **labels)

    await until(lambda: gauge("kvfleet_gateway_kv_event_streams_live") == 2, 15, "two streams")
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    try:
        a = prompt(7)
        first = await client.chat.completions.create(model="llama-3.1-8b", messages=a,  # type: ignore[arg-type]
                                                     max_tokens=2)  # fmt: skip
        (p,) = [u for u, _ in prefills if _counter(u, "prompt_tokens") > 0]
        await until(lambda: gauge("kvfleet_gateway_kv_events_total", backend=p, kind="stored"),
                    10, "the prefill engine's stored pages")  # fmt: skip
        # (the gateway serves on this loop: its metrics are read from a thread)
        assert (
            await asyncio.to_thread(gauge, "kvfleet_gateway_kv_events_total", backend=decode) == 0
        )
        again = await client.chat.completions.create(model="llama-3.1-8b", messages=a,  # type: ignore[arg-type]
                                                     max_tokens=2)  # fmt: skip
    finally:
        await client.close()
    assert first.usage is not None and again.usage is not None
    assert again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - PAGE
    assert _counter(p, "prompt_tokens") == 2 * first.usage.prompt_tokens  # both went to p
