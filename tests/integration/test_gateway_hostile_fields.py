"""Round three against a hostile tenant (issue 55, gateway side), over real HTTP: what the
engine will do, not what the gateway counted — every client-side error class of a stream
write ends as "client gone" and is billed the engine's work."""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvfleet_gateway.config import AdapterSource, Duration, GatewayConfig, Lora, Requests
from kvfleet_gateway.keys import hash_key
from kvfleet_gateway.routing import KvfleetTuning
from tests.integration.test_gateway_abuse import CANARY, billed, chat, keys, post
from tests.integration.test_lora import lora_sim
from tests.support.fake_engine import MODEL, chunk, fake_engine, usage
from tests.support.gateway import gateway_config

WRITE_ERRORS = [
    ConnectionResetError(),
    aiohttp.ClientConnectionResetError("Cannot write to closing transport"),
    ConnectionError("Connection lost"),
    BrokenPipeError(),
    aiohttp.ClientOSError(),
    TimeoutError(),
]
"""What a write to a client can raise in aiohttp 3.x: the transport closing, a paused
writer's peer resetting (`base_protocol`), a broken pipe, an OS error, a write timeout."""


@pytest.mark.parametrize("error", WRITE_ERRORS, ids=lambda e: type(e).__name__)
async def test_every_write_error_ends_as_client_gone_and_bills_the_engine(
    error: Exception, gateway_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 5: a client that stopped reading and reset raised ConnectionError('Connection
    lost'), not the ConnectionResetError `_stream` caught: an internal 500 with a traceback,
    the usage drain skipped, 12,012 of 14,867 engine tokens billed."""

    async def twenty_then_hang(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        # All twenty sent at once: the gateway's drain reads what the engine already sent
        # (for half a second), so a loaded machine must not make this a race.
        for i in range(1, 21):
            await resp.write(chunk("x", usage(10, i)))
        await asyncio.sleep(2)  # no [DONE] before the gateway cuts
        return resp

    real_write = web.StreamResponse.write
    writes = 0

    async def failing_write(self: web.StreamResponse, data: bytes) -> None:
        nonlocal writes
        if self.headers.get("X-Accel-Buffering") == "no":  # the gateway's SSE, not the engine's
            writes += 1
            if writes >= 2:
                raise error
        await real_write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", failing_write)
    async with fake_engine(twenty_then_hang) as engine:
        gw = await gateway_server(gateway_config([engine.url], keys(tmp_path)))
        async with aiohttp.ClientSession() as s:
            with contextlib.suppress(aiohttp.ClientError):  # the gateway cuts the stream
                async with s.post(f"{gw}/v1/chat/completions",
                                  json=chat(stream=True, max_tokens=100),
                                  headers={"Authorization": f"Bearer {CANARY}"}) as r:  # fmt: skip
                    await r.read()
        state = gateway_server.state(gw)
        for _ in range(50):
            if state.metrics.requests.labels("t", MODEL, "499")._value.get():
                break
            await asyncio.sleep(0.1)
        assert state.metrics.requests.labels("t", MODEL, "499")._value.get() == 1
        assert state.metrics.requests.labels("t", MODEL, "500")._value.get() == 0
        assert await billed(gateway_server, gw) == 10 + 20  # the engine's last counts


async def test_a_basic_authorization_is_told_to_use_bearer(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """Issue 54, item 7: `Authorization: Basic …` answered "missing API key"; the answer
    says the scheme is wrong and to use Bearer, and never echoes the credentials."""
    engine = await sim_server()
    gw = await gateway_server(gateway_config([engine], keys(tmp_path)))
    async with aiohttp.ClientSession() as s:
        for header, named in [(f"Basic {CANARY}", "'Basic'"), (CANARY, "another")]:
            async with s.post(f"{gw}/v1/chat/completions", json=chat(),
                              headers={"Authorization": header}) as r:  # fmt: skip
                text = await r.text()
            assert r.status == 401, text
            message = json.loads(text)["error"]["message"]
            assert f"uses the {named} scheme" in message and "Bearer <key>" in message
            assert CANARY not in text


async def _ok(request: web.Request, body: dict[str, Any]) -> web.Response:
    return web.json_response({"choices": [], "usage": usage(3, 1)})


LOOP_TEMPLATE = "{% for i in range(20000) %}hello world {% endfor %}"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"chat_template": LOOP_TEMPLATE}, "chat_template_kwargs.chat_template"),
        ({"enable_thinking": False, "tools": [{"x": 1}]}, "chat_template_kwargs.tools"),
        ({"documents": [{"text": "x" * 1000}]}, "chat_template_kwargs.documents"),
        ({"enable_thinking": "yes"}, "chat_template_kwargs.enable_thinking"),
    ],
)
async def test_chat_template_kwargs_carry_switches_not_templates(
    kwargs: dict[str, Any], param: str, gateway_server: Any, tmp_path: Path
) -> None:
    """Finding 1: `chat_template_kwargs: {"chat_template": <a loop>}` was forwarded and the
    engine's template rendered 100,001 prompt tokens for a reservation of 216. Only the
    template switches SGLang reads are forwarded, each of its type."""
    async with fake_engine(_ok) as engine:
        gw = await gateway_server(gateway_config([engine.url], keys(tmp_path)))
        status, err = await post(gw, chat(chat_template_kwargs=kwargs))
        assert status == 400 and err["error"]["param"] == param, err
        assert engine.bodies == []
        switches = {"enable_thinking": True, "thinking": False, "reasoning_effort": "low"}
        status, _ = await post(gw, chat(chat_template_kwargs=switches))
        assert status == 200 and engine.bodies[-1]["chat_template_kwargs"] == switches


BIG = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2_000)}}
"""A JSON schema of ~60 KB: over the 16 KiB grammar bound wherever it hides."""
MISTYPED = [
    ("/v1/chat/completions", '"top_logprobs": "100000", "logprobs": true', "top_logprobs",
     "an integer", "a string"),
    ("/v1/chat/completions", '"top_logprobs": 1e5, "logprobs": true', "top_logprobs",
     "an integer", "a number with a fraction"),
    ("/v1/chat/completions", '"temperature": "hot"', "temperature", "a number", "a string"),
    ("/v1/chat/completions", '"n": 1.0', "n", "an integer", "a number"),
    ("/v1/chat/completions", '"stream": "true"', "stream", "a boolean", "a string"),
    ("/v1/chat/completions", '"max_completion_tokens": "40"', "max_completion_tokens",
     "an integer", "a string"),
    ("/v1/completions", '"logprobs": "100000"', "logprobs", "an integer", "a string"),
    ("/generate", '"top_logprobs_num": 100000.0, "return_logprob": true', "top_logprobs_num",
     "an integer", "a number"),
    ("/generate", '"sampling_params": {"max_new_tokens": "9"}',
     "sampling_params.max_new_tokens", "an integer", "a string"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "extra", "param", "wanted", "got"), MISTYPED)
async def test_a_bound_field_takes_only_its_json_type(
    path: str, extra: str, param: str, wanted: str, got: str, gateway_server: Any, tmp_path: Path
) -> None:
    """Finding 2 and issue 54, item 8: `top_logprobs: "100000"` or `1e5` counted as 0 at
    the gateway and 100,000 at the engine (pydantic's lax mode); `temperature: "hot"` got
    200. Each is a 400 naming the field and the type, and the engine never sees it."""
    base = {
        "/v1/chat/completions": json.dumps(chat()),
        "/v1/completions": json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4}),
        "/generate": json.dumps({"text": "hi"}),
    }[path]
    async with fake_engine(_ok) as engine:
        gw = await gateway_server(gateway_config([engine.url], keys(tmp_path)))
        status, err = await post(gw, None, path, raw_body=base[:-1] + ", " + extra + "}")
        assert status == 400, err
        assert err["error"]["param"] == param, err
        assert f"must be {wanted}, got {got}" in err["error"]["message"], err
        assert engine.bodies == []


HIDDEN_GRAMMARS = [
    ("/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {}, "schema": BIG}),
     "response_format.schema"),
    ("/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": BIG}}),
     "response_format.json_schema"),
    ("/v1/chat/completions",
     chat(response_format={"type": "structural_tag", "triggers": ["<f"], "structures": [
         {"begin": "<f>", "schema": BIG, "end": "</f>"}]}), "response_format"),
    ("/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": BIG}}],
          tool_choice="required"), "tools"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "json_schema": json.dumps(BIG)},
     "json_schema"),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": json.dumps(BIG)}},
     "sampling_params.json_schema"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), HIDDEN_GRAMMARS)
async def test_every_place_a_grammar_hides_is_bounded(
    path: str, body: dict[str, Any], param: str, gateway_server: Any, tmp_path: Path
) -> None:
    """Finding 2: grammars over the bound passed as `response_format: {"type": "json_schema",
    "json_schema": {}, "schema": BIG}` and as a structural tag's `structures`."""
    async with fake_engine(_ok) as engine:
        gw = await gateway_server(gateway_config([engine.url], keys(tmp_path)))
        status, err = await post(gw, body, path)
        assert status == 400 and err["error"]["param"] == param, err
        assert engine.bodies == []
        assert await billed(gateway_server, gw) == 0


def _with_vocab(cfg: GatewayConfig, tmp_path: Path, vocab: int) -> GatewayConfig:
    """`cfg` with routing.tuning.modelConfig: a config.json of `vocab` tokens."""
    doc = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": vocab}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(doc))
    tuning = KvfleetTuning(model_config=str(tmp_path / "config.json"))
    return replace(cfg, routing=replace(cfg.routing, tuning=tuning))


IDS = [
    ("/v1/chat/completions", chat(input_ids=[-5, 10**12]), "input_ids"),
    ("/v1/chat/completions", chat(input_ids=[1, 1000]), "input_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 5000]}, "prompt"),
    ("/generate", {"input_ids": [3, 1000]}, "input_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"100000": 5}}},
     "sampling_params.logit_bias"),
    ("/v1/chat/completions", chat(stop_token_ids=[7, 999_999]), "stop_token_ids"),
    ("/generate", {"text": "hi", "return_logprob": True, "token_ids_logprob": [1000]},
     "token_ids_logprob"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), IDS)
async def test_token_ids_are_bounded_by_the_models_vocabulary(
    path: str, body: dict[str, Any], param: str, gateway_server: Any, tmp_path: Path
) -> None:
    """Finding 2: chat `input_ids: [-5, 10**12]` was forwarded (completions and /generate
    checked >= 0 only). Every token id is in [0, vocab_size) of the model's config.json; a
    gateway that does not know the vocabulary forwards none."""
    async with fake_engine(_ok) as engine:
        cfg = _with_vocab(gateway_config([engine.url], keys(tmp_path)), tmp_path, 1000)
        gw = await gateway_server(cfg)
        status, err = await post(gw, body, path)
        assert status == 400 and err["error"]["param"] == param, err
        assert "[0, 1000)" in err["error"]["message"] or "-5" in err["error"]["message"], err
        status, _ = await post(gw, chat(input_ids=[1, 999]))
        assert status == 200 and engine.bodies[-1]["input_ids"] == [1, 999]
        no_vocab = await gateway_server(gateway_config([engine.url], keys(tmp_path)))
        status, err = await post(no_vocab, chat(input_ids=[1, 2]))
        assert status == 400 and "routing.tuning.modelConfig" in err["error"]["message"], err
        assert len(engine.bodies) == 1


async def test_lora_path_is_subject_to_the_model_allow_list(
    gateway_server: Any, tmp_path: Path
) -> None:
    """Finding 3: with `requests.allow: [lora_path]`, a tenant limited to the base model got
    403 for `model: sql` and 200 for `lora_path: "sql"`."""
    async with fake_engine(_ok) as engine:
        allow = Requests(allow=("lora_path",))
        cfg = gateway_config([engine.url], keys(tmp_path, models=[MODEL]), requests=allow)
        gw = await gateway_server(cfg)
        for lora in ("sql", f"{MODEL}:sql"):
            status, err = await post(gw, {"text": "hi", "lora_path": lora}, "/generate")
            assert status == 403 and err["error"]["param"] == "lora_path", err
            status, err = await post(gw, chat(lora_path=lora))
            assert status == 403, err
        assert engine.bodies == []
        allowed = keys(tmp_path, models=[MODEL, "sql"])
        gw2 = await gateway_server(gateway_config([engine.url], allowed, requests=allow))
        status, _ = await post(gw2, {"text": "hi", "lora_path": f"{MODEL}:sql"}, "/generate")
        assert status == 200 and engine.bodies[-1]["lora_path"] == f"{MODEL}:sql"


async def test_openai_endpoints_require_model_and_generate_defaults_it(
    gateway_server: Any, tmp_path: Path
) -> None:
    """Issue 54, item 8: a chat body without `model` got 200. OpenAI's endpoints require it
    (400 naming it); SGLang's /generate, which has no such field, goes to the only model."""
    async with fake_engine(_ok) as engine:
        gw = await gateway_server(gateway_config([engine.url], keys(tmp_path)))
        for path, body in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"prompt": "hi"}),
        ]:
            status, err = await post(gw, body, path)
            assert status == 400 and err["error"]["param"] == "model", err
        assert engine.bodies == []
        status, _ = await post(gw, {"text": "hi"}, "/generate")
        assert status == 200 and len(engine.bodies) == 1


async def test_null_fields_are_left_out_of_what_is_forwarded(
    gateway_server: Any, tmp_path: Path
) -> None:
    """The engine is sent the parsed request: a field set to null is not set."""
    async with fake_engine(_ok) as engine:
        gw = await gateway_server(gateway_config([engine.url], keys(tmp_path)))
        status, _ = await post(gw, chat(temperature=None, stop=None, top_logprobs=None))
        assert status == 200
        assert not {"temperature", "stop", "top_logprobs"} & engine.bodies[-1].keys()


@contextlib.asynccontextmanager
async def _released(event: asyncio.Event) -> AsyncIterator[None]:
    """Whatever fails inside, `event` is set at the end (a held engine reply ends)."""
    try:
        yield
    finally:
        event.set()


async def test_budget_retry_after_is_when_a_request_of_this_size_fits(
    gateway_server: Any, tmp_path: Path
) -> None:
    """Issue 54, item 9: `Retry-After: 83408` (23 hours) on a budget 429, after which a
    request with max_tokens 20 was admitted at once; the remaining header subtracted the
    request's own reservation unannounced. Refused only by reservations in flight, a request
    is told to retry in a second; refused by what was spent, at the period's reset. The
    headers report the settled remainder and the reservations in flight apart."""
    release, arrived = asyncio.Event(), asyncio.Event()

    async def held(request: web.Request, body: dict[str, Any]) -> web.Response:
        if body["max_tokens"] > 3_000:
            arrived.set()
            await release.wait()
        return web.json_response({"choices": [], "usage": usage(10, 5)})

    async with fake_engine(held) as engine:
        gw = await gateway_server(gateway_config([engine.url], keys(tmp_path)))  # 5,000 a day
        big = asyncio.create_task(post(gw, chat(max_tokens=4_000)))
        await arrived.wait()
        async with aiohttp.ClientSession() as s, _released(release):
            auth = {"Authorization": f"Bearer {CANARY}"}
            async with s.post(f"{gw}/v1/chat/completions", json=chat(max_tokens=2_000),
                              headers=auth) as r:  # fmt: skip
                assert r.status == 429 and r.headers["Retry-After"] == "1"
                assert r.headers["x-kvfleet-budget-remaining-tokens"] == "5000"
                assert int(r.headers["x-kvfleet-budget-reserved-tokens"]) > 4_000
            release.set()
            assert (await big)[0] == 200
            async with s.post(f"{gw}/v1/chat/completions", json=chat(max_tokens=2_000),
                              headers=auth) as r:  # fmt: skip
                assert r.status == 200  # admitted: the reservation settled to 15 tokens
                assert r.headers["x-kvfleet-budget-remaining-tokens"] == str(5_000 - 15)
            async with s.post(f"{gw}/v1/chat/completions", json=chat(max_tokens=4_880),
                              headers=auth) as r:  # fmt: skip
                assert r.status == 429  # more than is left after what was spent: the reset
                assert int(r.headers["Retry-After"]) > 60


@pytest.mark.parametrize(
    ("limits", "present"),
    [
        ({}, set()),
        ({"requestsPerMinute": 60}, {"requests"}),
        ({"tokensPerMinute": 100_000}, {"tokens"}),
        ({"requestsPerMinute": 60, "tokensPerMinute": 100_000}, {"requests", "tokens"}),
    ],
)
async def test_rate_limit_headers_are_those_of_the_limits_that_apply(
    limits: dict[str, Any], present: set[str], gateway_server: Any, tmp_path: Path
) -> None:
    """Issue 54, item 10: the README promised every x-ratelimit header on every response.
    Each pair of limit/remaining/reset headers appears when its limit applies, as the README
    now says."""
    f = tmp_path / "keys.yaml"
    f.write_text(json.dumps({"tenants": [{"name": "t", "keys": [hash_key(CANARY)],
                                          "limits": limits}]}))  # fmt: skip
    async with fake_engine(_ok) as engine:
        gw = await gateway_server(gateway_config([engine.url], f))
        async with aiohttp.ClientSession() as s:
            auth = {"Authorization": f"Bearer {CANARY}"}
            async with s.post(f"{gw}/v1/chat/completions", json=chat(), headers=auth) as r:
                assert r.status == 200
                seen = {h.lower() for h in r.headers if h.lower().startswith("x-ratelimit-")}
    wanted = {f"x-ratelimit-{w}-{kind}" for kind in present
              for w in ("limit", "remaining", "reset")}  # fmt: skip
    assert seen == wanted


async def _adapter_gateway(
    sim_server: Any, gateway_server: Any, tmp_path: Path, lora: Lora
) -> tuple[str, Any]:
    """A gateway over one LoRA simulator (holding `sql`) for the tenant of `keys`."""
    engine = await lora_sim(sim_server, per_batch=2)
    cfg = replace(gateway_config([engine], keys(tmp_path)), lora=lora)
    return await gateway_server(cfg), cfg


SOURCES = tuple(
    AdapterSource(name=n, path=f"/adapters/{n}") for n in ("sql", "chat", "code", "math")
)


async def test_adapter_loads_are_rate_limited_per_tenant_and_charged(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """Finding 4: a tenant cycling adapters caused 39 loads in 24 requests, unbilled and
    unlimited. Each load it causes is billed `loadChargeTokens`; past
    `tenantLoadsPerMinute`, a request needing a load is a 429 (a held adapter still serves)."""
    lora = Lora(adapters=SOURCES, max_adapters_per_replica=8, tenant_loads_per_minute=2,
                load_charge_tokens=100)  # fmt: skip
    gw, _ = await _adapter_gateway(sim_server, gateway_server, tmp_path, lora)
    spent = 0
    for model in ("sql", "chat", "code"):  # sql is held: no load; chat and code load
        status, body = await post(gw, {**chat(max_tokens=2), "model": model})
        assert status == 200, body
        spent += body["usage"]["total_tokens"]
    assert await billed(gateway_server, gw) == spent + 2 * 100
    status, err = await post(gw, {**chat(max_tokens=2), "model": "math"})
    assert status == 429 and err["error"]["code"] == "adapter_loads_exceeded", err
    status, _ = await post(gw, {**chat(max_tokens=2), "model": "chat"})  # held: served
    assert status == 200


async def test_churn_cannot_evict_an_adapter_loaded_moments_ago(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """Finding 4: the churn doubled another tenant's adapter latency by evicting it. An
    adapter this gateway loaded less than `minResidency` ago is not unloaded for another:
    the churning request waits (503, Retry-After) instead."""
    lora = Lora(adapters=SOURCES, max_adapters_per_replica=2, min_residency=Duration(30))
    gw, _ = await _adapter_gateway(sim_server, gateway_server, tmp_path, lora)
    for model in ("chat", "code"):  # chat fills the replica; code evicts sql (not loaded here)
        status, body = await post(gw, {**chat(max_tokens=2), "model": model})
        assert status == 200, body
    status, err = await post(gw, {**chat(max_tokens=2), "model": "math"})
    assert status == 503 and err["error"]["code"] == "adapter_unavailable", err
    assert "lora.minResidency" in err["error"]["message"]
    for model in ("chat", "code"):  # both still held: no load
        assert (await post(gw, {**chat(max_tokens=2), "model": model}))[0] == 200
