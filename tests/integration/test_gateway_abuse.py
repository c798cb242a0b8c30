"""The gateway tried as an attacker and as a bad day would: every finding of the adversarial
review (issue 13) as a test, over real HTTP, against the simulator or an engine that
misbehaves on purpose."""

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvfleet_gateway.config import Duration, Limits, Requests, Timeouts, TokenBudget
from kvfleet_gateway.keys import hash_key
from tests.support.fake_engine import MODEL, chunk, fake_engine, sse, usage
from tests.support.gateway import budget_in_use, gateway_config, metrics_url

CANARY = "kvf-CANARY-7f3a9c"
"""A key whose every appearance outside the request that carried it is a leak."""
BUDGET = 5_000


def keys(tmp_path: Path, **limits: Any) -> Path:
    f = tmp_path / "keys.yaml"
    budget = {"tokenBudget": {"tokens": BUDGET, "period": "1d"}}
    f.write_text(
        json.dumps(
            {"tenants": [{"name": "t", "keys": [hash_key(CANARY)], "limits": budget | limits}]}
        )
    )
    return f


def auth(key: str = CANARY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def post(
    url: str,
    body: Any,
    path: str = "/v1/chat/completions",
    key: str = CANARY,
    raw_body: str | None = None,
) -> tuple[int, Any]:
    data = json.dumps(body) if raw_body is None else raw_body
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + path, data=data, headers=auth(key)) as r,
    ):
        raw = await r.read()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw


async def billed(gateway_server: Any, gw: str) -> int:
    state = gateway_server.state(gw)
    limits = state.config.limits_for("t", state.keys.ring.tenant("t").limits)
    used = await budget_in_use(state.store, "t", limits, time.time())
    active = await state.store.active_leases("t", time.time())
    assert active == 0, "a lease leaked"
    return int(used)


def chat(content: Any = "hello", **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


PAD = " word" * 60_000  # 60,000 words: ~60,000 tokens for any real tokenizer


@pytest.mark.parametrize(
    "door",
    ["role", "name", "tools", "tool_calls", "text_part", "system"],
)
async def test_no_field_gets_a_prompt_around_the_budget(
    door: str, sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """Finding 1: the reservation bounds every field the template reads; 50 parallel padded
    requests are refused or billed within the budget."""
    engine = await sim_server(time_scale=0.01, simulate_eos=False)
    gw = await gateway_server(gateway_config([engine], keys(tmp_path)))
    m: dict[str, Any] = {"role": "user", "content": "hi"}
    body = chat()
    if door == "role":
        m["role"] = "user" + PAD
    elif door == "name":
        m["name"] = PAD
    elif door == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "f", "description": PAD}}]
    elif door == "tool_calls":
        m = {
            "role": "assistant",
            "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": PAD}}],
        }
    elif door == "text_part":
        m["content"] = [{"type": "text", "text": PAD}]
    elif door == "system":
        body["messages"] = [{"role": "system", "content": PAD}, m]
    if door != "system":
        body["messages"] = [m] if door != "tool_calls" else [m, {"role": "user", "content": "x"}]
    results = await asyncio.gather(*(post(gw, body) for _ in range(50)))
    assert {status for status, _ in results} <= {200, 429}
    assert any(status == 429 for status, _ in results)
    assert await billed(gateway_server, gw) <= BUDGET


async def test_media_and_embeddings_cannot_be_bounded_and_are_refused(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    engine = await sim_server()
    gw = await gateway_server(gateway_config([engine], keys(tmp_path)))
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    for body, path in [
        (chat(image), "/v1/chat/completions"),
        ({"text": "hi", "input_embeds": [[0.1]]}, "/generate"),
        ({"text": "hi", "image_data": "http://x/y.png"}, "/generate"),
    ]:
        status, err = await post(gw, body, path)
        assert status == 400, err
    assert await billed(gateway_server, gw) == 0


async def test_a_stream_cut_after_its_first_chunk_is_billed_the_engines_prompt(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """Finding 2: the engine counted the prompt; the gateway bills its count, not 26."""
    engine = await sim_server(time_scale=0.5, simulate_eos=False)
    f = tmp_path / "keys.yaml"
    f.write_text(json.dumps({"tenants": [{"name": "t", "keys": [hash_key(CANARY)]}]}))
    cfg = gateway_config([engine], f, defaults=Limits(token_budget=TokenBudget(tokens=10**6)))
    gw = await gateway_server(cfg)
    body = chat(" word" * 20_000, stream=True, max_tokens=500)
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{gw}/v1/chat/completions", json=body, headers=auth()) as r,
    ):
        first = await r.content.readuntil(b"\n\n")
        assert b"usage" not in first  # the client did not ask for usage
    used = 0
    for _ in range(50):
        await asyncio.sleep(0.1)
        state = gateway_server.state(gw)
        if not state.metrics.inflight.labels("t", MODEL)._value.get():
            used = int(await budget_in_use(state.store, "t", cfg.limits.defaults, time.time()))
            break
    async with aiohttp.ClientSession() as s, s.get(f"{engine}/metrics") as r:
        text = await r.text()
    engine_prompt = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sglang:prompt_tokens_total")
    )
    assert engine_prompt > 20_000
    assert used >= engine_prompt


async def test_a_lone_surrogate_is_a_400_and_leaks_nothing(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """Finding 3: once a 500 that held the tenant's only slot and its reservation for 60 s."""
    engine = await sim_server()
    gw = await gateway_server(gateway_config([engine], keys(tmp_path, maxConcurrent=1)))
    raw = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", '
    raw += b'"content": "a\\ud800b"}], "max_tokens": 8}'
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{gw}/v1/chat/completions", data=raw, headers=auth()) as r,
    ):
        assert r.status == 400
        assert "surrogate" in (await r.json())["error"]["message"]
    assert (await post(gw, chat()))[0] == 200  # the one slot is free
    assert await billed(gateway_server, gw) > 0


async def raw_request(port: int, head: bytes, body: bytes = b"") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + b"\r\n\r\n" + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


async def test_secrets_never_reach_a_log_an_error_or_metrics(
    sim_server: Any, gateway_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 6 and 9: a canary key through every error path; /metrics on its own port."""
    caplog.set_level(logging.DEBUG)
    engine = await sim_server()
    cfg = gateway_config([engine], keys(tmp_path))
    gw = await gateway_server(cfg)
    port = int(gw.rsplit(":", 1)[1])
    body = json.dumps(chat()).encode()
    responses = []
    for value in [
        CANARY.encode() + b"\x01",  # a trailing control byte
        CANARY.encode() + b"\xff\xfe",  # not UTF-8
        CANARY.encode() + b"x",  # a wrong key that contains the real one
        b"Basic " + CANARY.encode(),
    ]:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\nAuthorization: Bearer "
            + value
        )
        answer = await raw_request(port, head, body)
        responses.append(answer)
        status = int(answer.split(b" ", 2)[1])
        assert 400 <= status < 500, answer[:200]
    # Bad bodies from the right key: each a 4xx that does not quote the request.
    for raw in [
        b"[" * 100_000,  # JSON nested 10^5 deep
        b'{"model": 1, "messages": "' + CANARY.encode() + b'"}',
        b"\xff" + CANARY.encode(),
    ]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{gw}/v1/chat/completions", data=raw, headers=auth()) as r,
        ):
            answer = await r.read()
            assert r.status == 400, answer[:200]
            responses.append(answer)
    assert (await post(gw, chat()))[0] == 200
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{gw}/metrics") as r:
            assert r.status == 404  # not on the clients' port
        async with s.get(metrics_url(cfg)) as r:
            metrics = await r.text()
    for where, text in [
        ("log", caplog.text),
        ("responses", b"".join(responses).decode(errors="replace")),
        ("metrics", metrics),
    ]:
        assert CANARY not in text and hash_key(CANARY) not in text, where


async def test_a_stopped_engine_times_out_after_idle_not_first_byte(
    sim_processes: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """Finding 7: a SIGSTOPped engine held a stream 120 s with idle set to 60 s."""
    engine = sim_processes("--time-scale", "1.0", "--no-eos")
    timeouts = Timeouts(first_byte=Duration(30), idle=Duration(1))
    gw = await gateway_server(gateway_config([engine], keys(tmp_path), timeouts=timeouts))
    pid = sim_processes.pid(engine)
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{gw}/v1/chat/completions", json=chat(stream=True, max_tokens=400), headers=auth()
        ) as r,
    ):
        await r.content.readuntil(b"\n\n")
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            rest = await asyncio.wait_for(r.content.read(), 10)
            waited = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
    assert b"engine timeout mid-stream" in rest
    assert waited < 3.0, waited
    errors = gateway_server.state(gw).metrics.upstream_errors.labels(engine, "timeout")
    assert errors._value.get() == 1


async def test_an_engine_silent_after_its_role_chunk_times_out_after_idle(
    gateway_server: Any, tmp_path: Path
) -> None:
    """SGLang's first event is the role chunk with empty content, sent after prefill; an engine
    that hangs right after it is idle, not still in its first_byte wait (CI saw a 30 s wait)."""
    role = chunk("").replace(
        b'"delta": {"content": ""}', b'"delta": {"role": "assistant", "content": ""}'
    )

    released = asyncio.Event()  # the engine hangs until the test is done (not 60 s more)

    async def hang_after_role(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = await sse(request, role)
        await released.wait()
        return resp

    async with fake_engine(hang_after_role) as engine:
        timeouts = Timeouts(first_byte=Duration(30), idle=Duration(1))
        gw = await gateway_server(gateway_config([engine.url], keys(tmp_path), timeouts=timeouts))
        t0 = time.monotonic()
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{gw}/v1/chat/completions", json=chat(stream=True), headers=auth()) as r,
        ):
            rest = await asyncio.wait_for(r.content.read(), 10)
        waited = time.monotonic() - t0
        released.set()
    assert b'"role": "assistant"' in rest and b"engine timeout mid-stream" in rest
    assert 1.0 <= waited < 3.0, waited


async def test_a_client_that_stops_reading_is_cut_after_client_write(
    gateway_server: Any, tmp_path: Path
) -> None:
    """Finding 7: a client that stops reading held its slot 120 s and was counted as an
    engine timeout; it is cut after client_write, as a client disconnect (499)."""

    async def firehose(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        with_usage = chunk("x" * 4000, usage(10, 1))
        for _ in range(20_000):  # 80 MB: more than every socket buffer on the way
            await resp.write(with_usage)
        return resp

    async with fake_engine(firehose) as engine:
        timeouts = Timeouts(client_write=Duration(1), idle=Duration(30))
        cfg = gateway_config([engine.url], keys(tmp_path, maxConcurrent=1), timeouts=timeouts)
        gw = await gateway_server(cfg)
        port = int(gw.rsplit(":", 1)[1])
        body = json.dumps(chat(stream=True, max_tokens=1000)).encode()
        _, writer = await asyncio.open_connection("127.0.0.1", port, limit=1024)
        writer.transport.pause_reading()  # the client stops reading
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"Authorization: Bearer "
            + CANARY.encode()
            + b"\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        await writer.drain()
        state = gateway_server.state(gw)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 15:
            if state.metrics.requests.labels("t", MODEL, "499")._value.get():
                break
            await asyncio.sleep(0.1)
        writer.close()
        assert state.metrics.requests.labels("t", MODEL, "499")._value.get() == 1
        assert time.monotonic() - t0 < 10
        assert state.metrics.upstream_errors.labels(engine.url, "timeout")._value.get() == 0
        assert (await post(gw, chat()))[0] in (200, 502)  # the slot is free again


@pytest.mark.parametrize(
    "case", ["negative_usage", "endless_line", "truncated_body", "no_done", "not_json"]
)
async def test_untrusted_upstream_data(case: str, gateway_server: Any, tmp_path: Path) -> None:
    """Finding 8: the engine's bytes are input like the client's."""

    async def reply(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if case == "negative_usage":
            return web.json_response(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
                    "usage": usage(-100_000, -5),
                }
            )
        if case == "endless_line":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: {")
            for _ in range(4000):  # 4 MB without an event boundary
                await resp.write(b"x" * 1024)
            return resp
        if case == "truncated_body":
            resp = web.StreamResponse(
                headers={"Content-Type": "application/json", "Content-Length": "1000"}
            )
            await resp.prepare(request)
            await resp.write(b'{"id": "x", "choi')
            assert request.transport is not None
            request.transport.close()
            return resp
        if case == "no_done":
            return await sse(request, chunk("a", usage(5, 1)), chunk("b", usage(5, 2)))
        return web.Response(text="<html>oops</html>", content_type="application/json")

    async with fake_engine(reply) as engine:
        gw = await gateway_server(gateway_config([engine.url], keys(tmp_path)))
        stream = case in ("endless_line", "no_done")
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{gw}/v1/chat/completions", json=chat(stream=stream), headers=auth()) as r,
        ):
            status, raw = r.status, await r.read()
        state = gateway_server.state(gw)
        if case == "negative_usage":
            assert status == 200
            assert await billed(gateway_server, gw) == 0  # never a credit
            assert state.metrics.usage_clamped.labels("t")._value.get() == 1
        elif stream:
            assert status == 200
            assert raw.rstrip().endswith(b"}")  # the last event is the gateway's error event
            assert b'"code": "upstream_error"' in raw.rsplit(b"data: ", 1)[1]
            assert len(raw) < 2 << 20  # the endless line was not buffered whole
        else:
            assert status == 502, raw
            assert json.loads(raw)["error"]["code"] == "upstream_error"
        await billed(gateway_server, gw)  # no lease left behind


async def test_engine_extras_are_governed_by_the_allow_list(
    gateway_server: Any, tmp_path: Path
) -> None:
    """Finding 10: cost-changing and internal SGLang fields no longer pass unchecked."""

    async def reply(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response(
            {"text": "hi", "meta_info": {"prompt_tokens": 3, "completion_tokens": 1}}
        )

    async with fake_engine(reply) as engine:
        gw = await gateway_server(gateway_config([engine.url], keys(tmp_path)))
        for body in [
            {"text": "hi", "sampling_params": {"n": 4}},
            {"text": "hi", "rid": "someone-elses-request"},
            {"text": "hi", "custom_logit_processor": "gASV..."},
            {"text": "hi", "lora_path": "adapter-a"},
            {"text": "hi", "bootstrap_host": "10.0.0.9"},
            {"text": "hi", "sampling_params": {"max_new_tokens": 4, "bogus": 1}},
            {"text": "hi", "whatever": 1},
        ]:
            status, err = await post(gw, body, "/generate")
            assert status == 400, body
            assert err["error"]["param"] is not None
        assert engine.bodies == []
        # Allowed by name in the config, lora_path passes; unknown fields may be dropped.
        allow = Requests(allow=("lora_path",), unknown_fields="drop")
        gw2 = await gateway_server(gateway_config([engine.url], keys(tmp_path), requests=allow))
        status, _ = await post(gw2, {"text": "hi", "lora_path": "a", "whatever": 1}, "/generate")
        assert status == 200
        assert engine.bodies[-1]["lora_path"] == "a" and "whatever" not in engine.bodies[-1]


async def test_odd_chunk_shapes_pass_through_without_a_server_error(
    gateway_server: Any, tmp_path: Path
) -> None:
    """An engine chunk whose `choices` holds something other than objects is relayed as is;
    it does not crash the stream."""

    async def reply(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        odd = b'data: {"id": "x", "choices": ["x", 1]}\n\n'
        return await sse(request, chunk("a", usage(5, 1)), odd, b"data: [DONE]\n\n")

    async with fake_engine(reply) as engine:
        gw = await gateway_server(gateway_config([engine.url], keys(tmp_path)))
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{gw}/v1/chat/completions", json=chat(stream=True), headers=auth()) as r,
        ):
            status, raw = r.status, await r.read()
        assert status == 200
        assert b'"choices": ["x", 1]' in raw and raw.rstrip().endswith(b"data: [DONE]")
        assert await billed(gateway_server, gw) == 6


async def test_a_bug_while_relaying_ends_the_stream_instead_of_hanging_it(
    sim_server: Any, gateway_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvfleet_gateway import engine_replies

    def broken(kind: str, payload: dict[str, Any]) -> str | None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(engine_replies, "content", broken)
    engine = await sim_server()
    gw = await gateway_server(gateway_config([engine], keys(tmp_path, maxConcurrent=1)))
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{gw}/v1/chat/completions", json=chat(stream=True), headers=auth()) as r,
    ):
        raw = await asyncio.wait_for(r.read(), 10)
    assert b"internal error in the gateway" in raw
    state = gateway_server.state(gw)
    assert state.metrics.requests.labels("t", MODEL, "500")._value.get() == 1
    await billed(gateway_server, gw)  # the slot and the reservation are released


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def test_a_slow_non_streaming_request_is_billed_and_sent_to_one_replica_only(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """Round two, finding 2: a non-streaming request outlasting `firstByte` was billed 0,
    retried on every replica, and its timeouts opened the breakers for everyone. Now its
    deadline is the whole response's; once sent it is never retried; it is billed its bound
    (at least what the engine did) and the breakers stay closed."""
    engines = [await sim_server(time_scale=0.04, simulate_eos=False) for _ in range(2)]
    timeouts = Timeouts(first_byte=Duration(1), min_decode_rate=10_000)  # 30,000 tokens: 4 s
    kf = keys(tmp_path, tokenBudget={"tokens": 1_000_000, "period": "1d"})
    gw = await gateway_server(gateway_config(engines, kf, timeouts=timeouts))
    body = chat(max_tokens=30_000, ignore_eos=True)
    started = time.monotonic()
    slow = await asyncio.gather(*(post(gw, body) for _ in range(3)))
    waited = time.monotonic() - started
    assert [status for status, _ in slow] == [504, 504, 504], slow
    assert slow[0][1]["error"]["code"] == "upstream_timeout"
    assert 3.5 < waited < 8.0, waited  # the whole-response deadline, not firstByte, not a retry
    status, _ = await post(gw, chat())  # the breakers did not open on slow accepted work
    assert status == 200
    await asyncio.sleep(0.5)  # the engines see the cuts and abort
    done = 0.0
    received = []
    async with aiohttp.ClientSession() as s:
        for engine in engines:
            async with s.get(f"{engine}/metrics") as r:
                text = await r.text()
            received.append(_counter(text, "sglang:num_requests_total"))
            done += _counter(text, "sglang:generation_tokens_total")
            done += _counter(text, "sglang:prompt_tokens_total")
    assert sum(received) <= 4, received  # 3 slow + 1 quick: nothing ran twice
    spent = await billed(gateway_server, gw)
    assert spent >= done > 3 * 1_000, (spent, done)  # billed at least the engines' work


BOUNDED = [
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=100_000), "top_logprobs",
     "topLogprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 50}, "logprobs",
     "topLogprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 1, "echo": True}, "echo",
     "promptLogprobs"),
    ("/generate", {"text": "hi", "return_logprob": True, "token_ids_logprob": list(range(50_000))},
     "token_ids_logprob", "tokenIdsLogprob"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 0,
                   "top_logprobs_num": 5}, "logprob_start_len", "promptLogprobs"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 1000},
     "top_logprobs_num", "topLogprobs"),
    ("/v1/chat/completions", chat(stop=[f"s{i}" for i in range(1000)]), "stop", "stop"),
    ("/v1/chat/completions", chat(stop="x" * 1000), "stop", "stopBytes"),
    ("/v1/chat/completions", chat(logit_bias={str(i): 1 for i in range(20_000)}), "logit_bias",
     "logitBias"),
    ("/v1/chat/completions", chat(ebnf='root ::= "a"' + " | \"a\"" * 6_000), "ebnf",
     "grammarBytes"),
    ("/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "string", "pattern": "(a+)+$" + "|a" * 20_000}}}),
     "response_format.json_schema", "grammarBytes"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 9}},
     "sampling_params.min_new_tokens", None),
    ("/v1/chat/completions", chat(min_tokens=100), "min_tokens", None),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "setting"), BOUNDED)
async def test_fields_that_cost_engine_work_are_bounded(
    path: str,
    body: dict[str, Any],
    param: str,
    setting: str | None,
    gateway_server: Any,
    tmp_path: Path,
) -> None:
    """Round two, finding 6: each refused with a 400 naming the field and its setting; the
    engine never sees it and nothing is billed."""
    async with fake_engine(lambda request, body: web.json_response({})) as engine:
        gw = await gateway_server(gateway_config([engine.url], keys(tmp_path)))
        status, err = await post(gw, body, path)
        assert status == 400, err
        assert err["error"]["param"] == param, err
        if setting is not None:
            assert f"requests.bounds.{setting}" in err["error"]["message"], err
        assert engine.bodies == []
        assert await billed(gateway_server, gw) == 0


async def test_non_finite_numbers_are_refused_not_forwarded_as_nan(
    gateway_server: Any, tmp_path: Path
) -> None:
    async with fake_engine(lambda request, body: web.json_response({})) as engine:
        gw = await gateway_server(gateway_config([engine.url], keys(tmp_path)))
        raw = json.dumps(chat())[:-1] + ", "  # the body, open for one more field
        for value in ("NaN", "Infinity", "-Infinity"):
            status, err = await post(gw, None, raw_body=raw + f'"temperature": {value}}}')
            assert status == 400 and value in err["error"]["message"], err
        assert engine.bodies == []


async def _raw(gw: str, data: bytes, read_for_s: float = 2.0) -> bytes:
    """Send raw bytes to the gateway; what it answers within `read_for_s`."""
    host, port = gw.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    out = b""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(read_for_s):
            while chunk := await reader.read(65536):
                out += chunk
    writer.close()
    return out


def _head(body_len: int, key: str = CANARY, extra: str = "") -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {body_len}\r\n{extra}\r\n"
    ).encode()


async def test_expect_continue_is_answered_after_auth_and_readyz_says_only_ready(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """Round two, finding 7: a bad key got `100 Continue` (its body then read); /readyz told
    anyone how many replicas were ready."""
    engine = await sim_server(time_scale=0.02)
    gw = await gateway_server(gateway_config([engine], keys(tmp_path)))
    body = json.dumps(chat()).encode()
    refused = await _raw(gw, _head(len(body), key="kvf-wrong", extra="Expect: 100-continue\r\n"))
    assert refused.startswith(b"HTTP/1.1 401") and b"100 Continue" not in refused, refused
    host, port = gw.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(_head(len(body), extra="Expect: 100-continue\r\n"))
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(body)
    final = await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)
    writer.close()
    assert final.startswith(b"HTTP/1.1 200"), final
    async with aiohttp.ClientSession() as s, s.get(f"{gw}/readyz") as r:
        assert r.status == 200 and await r.json() == {"ready": True}


async def test_a_client_that_leaves_is_a_499_without_a_traceback(
    gateway_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Round two, finding 5: leaving before the first byte was logged as a 500 with an
    "internal error" traceback, and leaving mid-body as an ERROR traceback each time (any
    key could flood the logs). Now each is one INFO line with status 499, and the request
    the engine accepted is billed by the same rule as any other."""

    async def slow_first_token(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(1.0)
        resp = await sse(request, chunk("hi", usage(3, 1)), b"data: [DONE]\n\n")
        return resp

    caplog.set_level(logging.INFO)
    async with fake_engine(slow_first_token) as engine:
        gw = await gateway_server(gateway_config([engine.url], keys(tmp_path)))
        body = json.dumps(chat(stream=True)).encode()
        await _raw(gw, _head(len(body)) + body, read_for_s=0.2)  # gone before the first byte
        await _raw(gw, _head(len(body)) + body[:20], read_for_s=0.2)  # gone mid-body
        await asyncio.sleep(1.5)
        assert len(engine.bodies) == 1  # the mid-body one never reached an engine
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [r.getMessage() for r in errors]
    assert not any(r.exc_info for r in caplog.records)
    access = [json.loads(r.getMessage()) for r in caplog.records
              if r.name == "kvfleet.gateway.access"]  # fmt: skip
    assert [a["status"] for a in access] == [499], access
    left = [r.getMessage() for r in caplog.records if "left" in r.getMessage()]
    assert len(left) == 2, [r.getMessage() for r in caplog.records]
    counted = gateway_server.state(gw).metrics.requests
    # (a body that never arrived names no model)
    assert [counted.labels("t", m, "499")._value.get() for m in (MODEL, "")] == [1, 1]


async def test_idle_and_slowloris_connections_cannot_exhaust_the_gateway(
    sim_processes: Any, tmp_path: Path
) -> None:
    """Round two, finding 4: no header-read timeout and an hour of idle keep-alive; at
    `ulimit -n 1024`, 1,100 idle connections made every honest request fail. Now, with the
    gateway as a process at that limit: 2,000 idle and 200 trickling connections from one
    address are capped (the rest closed at once), then closed by the idle and header
    timeouts, while every honest request from another address succeeds."""
    import sys

    from kvfleet_bench.hostile_clients import closed_within
    from kvfleet_sim.procs import free_port, running_process

    engine = sim_processes("--time-scale", "0.02")
    connections = {"keepaliveTimeout": "2s", "headerTimeout": "1s", "maxPerAddress": 300,
                   "maxTotal": 700}  # fmt: skip
    config = gateway_config([engine], keys(tmp_path))
    port = free_port()
    doc = config.to_dict()
    doc["listen"].update(port=port, connections=connections)
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps(doc))
    gw = f"http://127.0.0.1:{port}"
    argv = ["bash", "-c", f'ulimit -n 1024 && exec "{sys.executable}" -m kvfleet_cli gateway '
            f"--config {path}"]  # fmt: skip
    with running_process(argv, ready_url=f"{gw}/readyz", log_path=tmp_path / "gateway.log"):
        attacker: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        for i in range(2_000):
            attacker.append(await asyncio.open_connection("127.0.0.1", port,
                                                          local_addr=("127.0.0.2", 0)))  # fmt: skip
            if i % 100 == 99:  # (past its listen backlog a burst never reaches the gateway)
                await asyncio.sleep(0.05)
        trickle = []
        for _ in range(200):
            r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Slow: ")
            trickle.append((r, w))
        statuses = []
        for _ in range(20):
            statuses.append((await post(gw, chat()))[0])
            for _, w in trickle:  # one byte of a header each, never finishing it
                with contextlib.suppress(ConnectionError):
                    w.write(b"a")
        assert statuses == [200] * 20, statuses

        ended = await asyncio.gather(*(closed_within(r, 6) for r, _ in attacker + trickle))
        for _, w in attacker + trickle:
            w.close()
        still = [i for i, e in enumerate(ended) if not e]
        assert all(ended), (
            f"{len(still)} attacker connections still open: {still[:5]}..{still[-5:]}"
        )
    log = (tmp_path / "gateway.log").read_text()
    assert "no complete request headers within 1s" in log and "Traceback" not in log


async def test_refused_and_hostile_bodies_cost_no_other_tenant_its_latency(
    sim_processes: Any, redis_proc: Any, tmp_path: Path
) -> None:
    """Round two, finding 1: a key whose budget was spent sent 1.4 MB nested bodies: each got
    429 after ~0.9 s of gateway CPU (parse, then a depth walk), and another tenant's p50 went
    from 3 ms to 955 ms; a 6 KB gzip of such a body cost 1.3-1.7 s. Now the spent key is
    refused from its headers (a refusal that stands), a fresh key's bomb by a count of its
    containers before decoding, gzip with 415 before reading: 4 clients of them leave an
    honest tenant's median near its own when alone and its p90 under 50 ms (the gateway a
    process of its own, on the same cores)."""
    import sys

    from kvfleet_sim.procs import free_port, running_process

    engine = sim_processes("--time-scale", "0.02")
    tenants = [{"name": "t", "keys": [hash_key(CANARY)]},
               {"name": "spent", "keys": [hash_key("kvf-spent")],
                "limits": {"tokenBudget": {"tokens": 1_000, "period": "1d"}}},
               {"name": "fresh", "keys": [hash_key("kvf-fresh")]}]  # fmt: skip
    kf = tmp_path / "keys.yaml"
    kf.write_text(json.dumps({"tenants": tenants}))
    port = free_port()
    doc = gateway_config([engine], kf, store=redis_proc.url).to_dict()
    doc["listen"]["port"] = port
    doc["accessLog"] = False
    (tmp_path / "gateway.yaml").write_text(json.dumps(doc))
    period = int(time.time() // 86400)
    redis_proc.client().hset("kvf:{spent}:budget", str(period), 1_000)  # spent to the token
    gw = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "kvfleet_cli",
        "gateway",
        "--config",
        str(tmp_path / "gateway.yaml"),
    ]

    async def honest(n: int) -> list[float]:
        out = []
        async with aiohttp.ClientSession() as s:
            for _ in range(n):
                t0 = time.perf_counter()
                async with s.post(f"{gw}/v1/chat/completions", json=chat(max_tokens=2),
                                  headers=auth()) as r:  # fmt: skip
                    assert r.status == 200, await r.text()
                out.append(time.perf_counter() - t0)
                await asyncio.sleep(0.02)
        return out

    with running_process(argv, ready_url=f"{gw}/readyz", log_path=tmp_path / "gateway.log"):
        alone = await honest(60)
        # The hostile clients in a process of their own (their uploads would otherwise hold
        # up this loop, and the honest client's measurement with it).
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvfleet_bench.hostile_clients",
            gw,
            MODEL,
            "15",
            stdout=asyncio.subprocess.PIPE,
        )
        await asyncio.sleep(0.3)
        attacked = await honest(60)
        out, _ = await proc.communicate()
    result = json.loads(out.decode().splitlines()[-1])
    # The spent key: one ordinary request learns that its budget is gone for the day; from
    # then on its requests are refused from their headers, bodies unread.
    assert result["spent"] == [429] * 31, result["spent"]
    # The fresh key's bombs: refused by their container count, then by its share of parsing.
    assert set(result["fresh"]) == {400, 429} and set(result["gzip"]) == {415}, result
    p99 = sorted(attacked)[int(0.99 * len(attacked)) - 1]
    base = sorted(alone)[int(0.99 * len(alone)) - 1]
    print(f"honest TTFT: alone p50 {sorted(alone)[30] * 1000:.1f} ms p99 {base * 1000:.1f} ms; "
          f"under attack p50 {sorted(attacked)[30] * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms; "
          f"worst {[round(x * 1000) for x in sorted(attacked)[-4:]]}")  # fmt: skip
    # Before the fix the honest median was 955 ms. The bounds are on the median and p90: with
    # 60 samples on two shared cores, p99 is the second-worst sample, one scheduling blip.
    p50, p90 = sorted(attacked)[30], sorted(attacked)[int(0.9 * len(attacked)) - 1]
    assert p50 <= max(3 * sorted(alone)[30], sorted(alone)[30] + 0.010), (p50, sorted(alone)[30])
    assert p90 < 0.050, p90
