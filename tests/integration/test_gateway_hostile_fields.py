"""Round three against a hostile tenant (issue 55, gateway side), over real HTTP: what the
engine will do, not what the gateway counted — every client-side error class of a stream
write ends as "client gone" and is billed the engine's work."""

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.integration.test_gateway_abuse import CANARY, billed, chat, keys
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
        for i in range(1, 21):
            await resp.write(chunk("x", usage(10, i)))
            await asyncio.sleep(0.01)
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
