"""Forward one admitted request to an engine and the answer back, as it arrives.

Streams are relayed event by event (SSE events end with a blank line): an event is written
to the client the moment its last byte arrives from the engine. The gateway reads usage from
the engine's stream (it always asks for it) and drops the usage-only chunk when the client
did not ask for it. A request that fails before any byte reached the client is retried once
on another replica; after that, failures end the stream with an error event.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvfleet_gateway.backends import Backend, BackendPool
from kvfleet_gateway.config import Timeouts
from kvfleet_gateway.errors import GatewayError
from kvfleet_gateway.inbound import CHARS_PER_TOKEN_ESTIMATE, ClientRequest
from kvfleet_gateway.metrics import GatewayMetrics, Usage
from kvfleet_gateway.routing import RouteInfo, Router

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "generate": "/generate"}
MAX_ATTEMPTS = 2
DONE = b"data: [DONE]\n\n"


@dataclass
class Exchange:
    """One request's progress, filled in as it goes; read at the end for billing and logs."""

    tenant: str
    req: ClientRequest
    started: float = field(default_factory=time.monotonic)
    backend: Backend | None = None
    status: int = 0
    first_token_at: float | None = None
    prev_token_at: float = 0.0
    last_token_at: float | None = None
    usage: Usage | None = None
    content_chunks: int = 0
    content_chars: int = 0
    client_gone: bool = False

    def billed_usage(self) -> Usage:
        """The engine's numbers when it sent them; else an estimate of what was served."""
        if self.usage is not None:
            return self.usage
        if self.first_token_at is None:
            return Usage(0, 0)  # nothing was generated: nothing to charge
        completion = max(
            self.content_chunks, math.ceil(self.content_chars / CHARS_PER_TOKEN_ESTIMATE)
        )
        return Usage(self.req.estimated_prompt_tokens, min(completion, self.req.max_tokens))


@dataclass
class Proxy:
    session: aiohttp.ClientSession
    pool: BackendPool
    router: Router
    timeouts: Timeouts
    metrics: GatewayMetrics

    async def _open(self, ex: Exchange) -> tuple[Backend, aiohttp.ClientResponse]:
        req = ex.req
        info = RouteInfo(req.model, req.prompt_text, req.reserve_tokens)
        tried: set[str] = set()
        last_error = "no healthy backend serves this model"
        for _ in range(MAX_ATTEMPTS):
            candidates = [b for b in self.pool.routable(req.model) if b.url not in tried]
            if not candidates:
                break
            backend = self.router.choose(info, candidates)
            tried.add(backend.url)
            try:
                async with asyncio.timeout(self.timeouts.first_byte_s):
                    resp = await self.session.post(f"{backend.url}{PATHS[req.kind]}", json=req.body)
            except (aiohttp.ClientError, TimeoutError) as exc:
                kind = "timeout" if isinstance(exc, TimeoutError) else "connect"
                self.metrics.upstream_errors.labels(backend.url, kind).inc()
                backend.failures += 1
                last_error = f"engine {kind} error"
                continue
            if resp.status >= 500:
                self.metrics.upstream_errors.labels(backend.url, f"http_{resp.status}").inc()
                resp.release()
                last_error = f"engine answered {resp.status}"
                continue
            return backend, resp
        raise GatewayError(
            503 if not tried else 502,
            f"no engine could take the request ({last_error})",
            "server_error",
            "upstream_unavailable",
        )

    async def forward(
        self, request: web.Request, ex: Exchange, headers: dict[str, str]
    ) -> web.StreamResponse:
        backend, upstream = await self._open(ex)
        ex.backend = backend
        backend.inflight_requests += 1
        backend.inflight_tokens += ex.req.reserve_tokens
        try:
            if upstream.status >= 400:
                return await self._error_passthrough(ex, upstream, headers)
            if ex.req.stream:
                return await self._stream(request, ex, upstream, headers)
            return await self._whole(ex, upstream, headers)
        finally:
            upstream.close()
            backend.inflight_requests -= 1
            backend.inflight_tokens -= ex.req.reserve_tokens

    async def _error_passthrough(
        self, ex: Exchange, upstream: aiohttp.ClientResponse, headers: dict[str, str]
    ) -> web.Response:
        raw = await upstream.read()
        ex.status = upstream.status
        try:
            data = json.loads(raw)
        except ValueError:
            data = {"message": raw.decode(errors="replace")}
        if not (isinstance(data, dict) and isinstance(data.get("error"), dict)):
            message = data.get("message") if isinstance(data, dict) else str(data)
            if isinstance(data, dict) and isinstance(data.get("error"), str):
                message = data["error"]
            data = GatewayError(
                upstream.status,
                str(message),
                "invalid_request_error",
                param=data.get("param") if isinstance(data, dict) else None,
            ).body()
        return web.json_response(data, status=upstream.status, headers=headers)

    async def _whole(
        self, ex: Exchange, upstream: aiohttp.ClientResponse, headers: dict[str, str]
    ) -> web.Response:
        async with asyncio.timeout(self.timeouts.first_byte_s + self.timeouts.idle_s):
            raw = await upstream.read()
        ex.status = upstream.status
        ex.first_token_at = ex.last_token_at = time.monotonic()
        try:
            data = json.loads(raw)
            ex.usage = _usage(ex.req.kind, data)
        except ValueError:
            pass
        return web.Response(
            body=raw, status=upstream.status, headers=headers, content_type="application/json"
        )

    async def _stream(
        self,
        request: web.Request,
        ex: Exchange,
        upstream: aiohttp.ClientResponse,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200,
            headers={
                **headers,
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
        )
        await resp.prepare(request)  # rate-limit headers reach the client before any token
        ex.status = 200
        buffer = b""
        deadline = self.timeouts.first_byte_s
        labels = (ex.tenant, ex.req.model)
        try:
            while True:
                try:
                    async with asyncio.timeout(deadline):
                        data = await upstream.content.readany()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    kind = "timeout" if isinstance(exc, TimeoutError) else "stream"
                    assert ex.backend is not None
                    self.metrics.upstream_errors.labels(ex.backend.url, kind).inc()
                    await self._write(resp, ex, _error_event(f"engine {kind} error mid-stream"))
                    ex.status = 502
                    break
                if not data:
                    break
                deadline = self.timeouts.idle_s
                buffer += data
                while (end := buffer.find(b"\n\n")) >= 0:
                    event, buffer = buffer[: end + 2], buffer[end + 2 :]
                    out = self._observe(ex, event)
                    if out:
                        await self._write(resp, ex, out)
                        now = ex.last_token_at
                        if now is not None and ex.content_chunks > 1:
                            self.metrics.itl.labels(*labels).observe(now - ex.prev_token_at)
        except (ConnectionResetError, TimeoutError):
            ex.client_gone = True  # client hung up or stopped reading: stop, engine aborts
            ex.status = 499
        if not ex.client_gone:
            await resp.write_eof()
        return resp

    async def _write(self, resp: web.StreamResponse, ex: Exchange, data: bytes) -> None:
        async with asyncio.timeout(self.timeouts.client_write_s):
            await resp.write(data)

    def _observe(self, ex: Exchange, event: bytes) -> bytes | None:
        """Learn from one SSE event; return what to send the client (None: drop it)."""
        if not event.startswith(b"data: {"):
            return event
        try:
            payload = json.loads(event[6:])
        except ValueError:
            return event
        if not isinstance(payload, dict):
            return event
        usage = _usage(ex.req.kind, payload)
        if usage is not None:
            ex.usage = usage
        content = _content(ex.req.kind, payload)
        if content is not None:
            now = time.monotonic()
            if ex.first_token_at is None:
                ex.first_token_at = now
            ex.prev_token_at = ex.last_token_at or now
            ex.last_token_at = now
            ex.content_chunks += 1
            # /generate streams cumulative text; the OpenAI endpoints stream deltas
            ex.content_chars = (
                len(content) if ex.req.kind == "generate" else (ex.content_chars + len(content))
            )
        if (
            usage is not None
            and ex.req.kind != "generate"
            and not payload.get("choices")
            and not ex.req.client_wants_usage
        ):
            return None  # the usage chunk the client did not ask for
        return event


def _usage(kind: str, payload: dict[str, Any]) -> Usage | None:
    if kind == "generate":
        meta = payload.get("meta_info")
        if isinstance(meta, dict) and "completion_tokens" in meta:
            return Usage(
                int(meta.get("prompt_tokens", 0)),
                int(meta["completion_tokens"]),
                int(meta.get("cached_tokens", 0) or 0),
            )
        return None
    u = payload.get("usage")
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details") or {}
    return Usage(
        int(u.get("prompt_tokens", 0)),
        int(u.get("completion_tokens", 0)),
        int(details.get("cached_tokens", 0) or 0) if isinstance(details, dict) else 0,
    )


def _content(kind: str, payload: dict[str, Any]) -> str | None:
    """The new text in a chunk (None for chunks that carry no generated text)."""
    if kind == "generate":
        text = payload.get("text")
        return text if isinstance(text, str) else None
    choices = payload.get("choices")
    if not choices or not isinstance(choices, list):
        return None
    c = choices[0]
    if kind == "chat":
        delta = c.get("delta") or {}
        text = delta.get("content")
    else:
        text = c.get("text")
    return text if isinstance(text, str) and text else None


def _error_event(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "code": "upstream_error"}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
