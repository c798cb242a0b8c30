"""An engine that misbehaves on purpose, for the gateway's fault tests: it answers the
probes like SGLang (/health, /v1/models, /metrics) and then sends what the test asks for."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvfleet_sim.procs import free_port

MODEL = "llama-3.1-8b"
Reply = Callable[[web.Request, dict[str, Any]], Any]
"""async (request, body) -> web.StreamResponse"""


@dataclass
class FakeEngine:
    url: str
    reply: Reply
    bodies: list[dict[str, Any]] = field(default_factory=list)
    """Every generation body the gateway forwarded."""


def chunk(content: str, usage: dict[str, int] | None = None) -> bytes:
    payload: dict[str, Any] = {
        "id": "x",
        "object": "chat.completion.chunk",
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    if usage is not None:
        payload["usage"] = usage
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def sse(request: web.Request, *events: bytes, pause: float = 0.0) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for e in events:
        await resp.write(e)
        if pause:
            await asyncio.sleep(pause)
    return resp


@asynccontextmanager
async def fake_engine(reply: Reply) -> AsyncIterator[FakeEngine]:
    port = free_port()
    engine = FakeEngine(f"http://127.0.0.1:{port}", reply)

    async def generation(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        engine.bodies.append(body)
        resp: web.StreamResponse = await engine.reply(request, body)
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 8192}]}
        )

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", generation)
    app.router.add_post("/v1/completions", generation)
    app.router.add_post("/generate", generation)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield engine
    finally:
        await runner.cleanup()
