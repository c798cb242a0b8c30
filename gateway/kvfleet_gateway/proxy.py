"""Forward one admitted request to an engine and the answer back, as it arrives.

Streams are relayed event by event (SSE events end with a blank line): an event is written
to the client the moment its last byte arrives from the engine. The gateway reads usage from
the engine's stream (it always asks for it) and drops the usage-only chunk when the client
did not ask for it. A request that fails before any byte reached the client is retried once
on another replica; after that, failures end the stream with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvfleet_gateway.backends import Backend, BackendPool
from kvfleet_gateway.config import Hold, Timeouts
from kvfleet_gateway.errors import GatewayError
from kvfleet_gateway.inbound import CHARS_PER_TOKEN_ESTIMATE, ClientRequest
from kvfleet_gateway.metrics import GatewayMetrics, Usage
from kvfleet_gateway.routing import Policy, RouteRequest

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "generate": "/generate"}
MAX_ATTEMPTS = 3
"""Tries before the first byte (each on a different replica)."""
RETRY_BACKOFF_S = 0.05
HOLD_POLL_S = 0.2
"""How often a held request looks for a replica again."""
log = logging.getLogger("kvfleet.gateway")
"""Pause before the second try, doubled before each later one."""
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


@dataclass
class Exchange:
    """One request's progress, filled in as it goes; read at the end for billing and logs."""

    tenant: str
    req: ClientRequest
    route: RouteRequest
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
    last_event: bytes = b""
    on_first_token: Callable[[], None] | None = None

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

    def token_arrived(self) -> None:
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            if self.on_first_token is not None:
                self.on_first_token()
        self.prev_token_at = self.last_token_at or now
        self.last_token_at = now
        self.content_chunks += 1


@dataclass
class Proxy:
    session: aiohttp.ClientSession
    pool: BackendPool
    policy: Policy
    timeouts: Timeouts
    metrics: GatewayMetrics
    hold: Hold = field(default_factory=Hold)
    _held: int = 0

    async def _wait_for_capacity(self, model: str) -> list[Backend]:
        """No replica of `model` exists (scaled to zero, or all starting): hold the request
        (bounded in number and time) until one can take it — the autoscaler sees the held
        count and wakes one."""
        retry = str(max(1, math.ceil(self.hold.timeout)))
        if self._held >= self.hold.max_requests:
            raise GatewayError(
                503,
                f"no replica of '{model}' is available and {self._held} requests already "
                "wait for one; retry later",
                "server_error",
                "no_capacity",
                headers={"Retry-After": retry},
            )
        self._held += 1
        gauge = self.metrics.held.labels(model)
        gauge.inc()
        log.info("holding a request for %s: no replica available (%d held)", model, self._held)
        try:
            deadline = time.monotonic() + self.hold.timeout
            while time.monotonic() < deadline:
                candidates = self.pool.routable(model)
                if candidates:
                    return candidates
                await asyncio.sleep(HOLD_POLL_S)
        finally:
            self._held -= 1
            gauge.dec()
        raise GatewayError(
            503,
            f"no replica of '{model}' became available within {self.hold.timeout:g}s",
            "server_error",
            "no_capacity",
            headers={"Retry-After": retry},
        )

    async def _open(self, ex: Exchange) -> tuple[Backend, aiohttp.ClientResponse]:
        """Pick a replica and send; on failure before any byte, back off and try another."""
        req = ex.req
        tried: set[str] = set()
        last_error = "no healthy backend serves this model"
        for attempt in range(MAX_ATTEMPTS):
            candidates = [b for b in self.pool.routable(req.model) if b.url not in tried]
            if not candidates and attempt == 0 and not self.pool.has_members(req.model):
                candidates = await self._wait_for_capacity(req.model)
            if not candidates:
                break
            if attempt:
                await asyncio.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 1))
            now = time.monotonic()
            key = self.policy.choose(ex.route, [b.candidate(now) for b in candidates])
            backend = self.pool.backends[key]
            tried.add(key)
            backend.breaker.attempt()
            # In flight from the moment it is chosen: routing must see requests whose
            # response has not started yet (a non-streaming answer arrives all at once).
            backend.inflight_requests += 1
            backend.inflight_tokens += req.reserve_tokens
            try:
                async with asyncio.timeout(self.timeouts.first_byte):
                    resp = await self.session.post(f"{backend.url}{PATHS[req.kind]}", json=req.body)
            except (aiohttp.ClientError, TimeoutError) as exc:
                kind = "timeout" if isinstance(exc, TimeoutError) else "connect"
                self.metrics.upstream_errors.labels(backend.url, kind).inc()
                backend.breaker.failure()
                self._not_in_flight(backend, ex)
                last_error = f"engine {kind} error"
                continue
            if resp.status >= 500:
                self.metrics.upstream_errors.labels(backend.url, f"http_{resp.status}").inc()
                backend.breaker.failure()
                self._not_in_flight(backend, ex)
                resp.release()
                last_error = f"engine answered {resp.status}"
                continue
            backend.breaker.success()
            return backend, resp
        self.policy.on_finished(ex.route, "")
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
        ex.on_first_token = lambda: self.policy.on_first_token(ex.route, backend.url)
        try:
            if upstream.status >= 400:
                return await self._error_passthrough(ex, upstream, headers)
            if ex.req.stream:
                return await self._stream(request, ex, upstream, headers)
            return await self._whole(ex, upstream, headers)
        finally:
            if ex.client_gone or not upstream.content.at_eof():
                upstream.close()  # cut: the engine sees the disconnect and aborts the request
            else:
                upstream.release()  # clean end: keep the connection for the next request
            self.policy.on_finished(ex.route, backend.url)
            self._not_in_flight(backend, ex)

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
            param = data.get("param") if isinstance(data, dict) else None
            data = GatewayError(upstream.status, str(message), param=param).body()
        return web.json_response(data, status=upstream.status, headers=headers)

    async def _whole(
        self, ex: Exchange, upstream: aiohttp.ClientResponse, headers: dict[str, str]
    ) -> web.Response:
        async with asyncio.timeout(self.timeouts.first_byte + self.timeouts.idle):
            raw = await upstream.read()
        ex.status = upstream.status
        ex.token_arrived()
        with contextlib.suppress(ValueError):
            ex.usage = _usage(ex.req.kind, json.loads(raw))
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
        resp = web.StreamResponse(status=200, headers={**headers, **SSE_HEADERS})
        await resp.prepare(request)  # rate-limit headers reach the client before any token
        ex.status = 200
        t = self.timeouts
        loop = asyncio.get_running_loop()
        itl = self.metrics.itl.labels(ex.tenant, ex.req.model)
        buffer = b""
        # One watchdog per stream, pushed forward as data flows (much cheaper than a timeout
        # per chunk): first_byte_s before the first chunk, then idle_s of upstream silence
        # or client_write_s of a client that does not take data, whichever is longer.
        slack = max(t.idle, t.client_write)
        try:
            async with asyncio.timeout(t.first_byte) as guard:
                while True:
                    try:
                        data = await upstream.content.readany()
                    except aiohttp.ClientError:
                        self._upstream_failed(ex, "stream")
                        await resp.write(_error_event("engine stream error mid-stream"))
                        break
                    if not data:
                        break
                    when = guard.when()
                    if when is not None and when - loop.time() < slack / 2:
                        guard.reschedule(loop.time() + slack)
                    buffer += data
                    ready: list[bytes] = []
                    while (end := buffer.find(b"\n\n")) >= 0:
                        event, buffer = buffer[: end + 2], buffer[end + 2 :]
                        out = self._observe(ex, event)
                        if out:
                            ready.append(out)
                            if ex.content_chunks > 1 and ex.last_token_at is not None:
                                itl.observe(ex.last_token_at - ex.prev_token_at)
                    if ready:  # events that arrived together leave together: one write
                        await resp.write(ready[0] if len(ready) == 1 else b"".join(ready))
        except TimeoutError:
            self._upstream_failed(ex, "timeout")
            with contextlib.suppress(ConnectionResetError):
                await resp.write(_error_event("engine timeout mid-stream"))
        except ConnectionResetError:
            ex.client_gone = True  # client hung up: stop reading, the engine aborts
            ex.status = 499
        if ex.usage is None and ex.last_event:
            self._observe(ex, ex.last_event, final=True)
        if not ex.client_gone:
            with contextlib.suppress(ConnectionResetError):
                await resp.write_eof()
        return resp

    @staticmethod
    def _not_in_flight(backend: Backend, ex: Exchange) -> None:
        backend.inflight_requests -= 1
        backend.inflight_tokens -= ex.req.reserve_tokens

    def _upstream_failed(self, ex: Exchange, kind: str) -> None:
        assert ex.backend is not None
        self.metrics.upstream_errors.labels(ex.backend.url, kind).inc()
        ex.status = 502

    def _observe(self, ex: Exchange, event: bytes, final: bool = False) -> bytes | None:
        """Learn from one SSE event; return what to send the client (None: drop it)."""
        if not event.startswith(b"data: {"):
            return event
        kind = ex.req.kind
        if kind == "generate" and not final:
            # Native chunks carry cumulative text and usage: keep the latest, parse it once
            # at the end; meanwhile only count arrivals.
            ex.last_event = event
            ex.token_arrived()
            return event
        try:
            payload = json.loads(event[6:])
        except ValueError:
            return event
        if not isinstance(payload, dict):
            return event
        usage = _usage(kind, payload)
        if usage is not None:
            ex.usage = usage
        content = _content(kind, payload)
        if content is not None and not final:
            ex.token_arrived()
            ex.content_chars += len(content)
        if (
            usage is not None
            and kind != "generate"
            and not payload.get("choices")
            and (not ex.req.client_wants_usage)
        ):
            return None  # the usage chunk the client did not ask for
        return event


def _usage(kind: str, payload: Any) -> Usage | None:
    if not isinstance(payload, dict):
        return None
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
    cached = int(details.get("cached_tokens", 0) or 0) if isinstance(details, dict) else 0
    return Usage(int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0)), cached)


def _content(kind: str, payload: dict[str, Any]) -> str | None:
    """The new text in a chunk (None for chunks that carry no generated text)."""
    choices = payload.get("choices")
    if not choices or not isinstance(choices, list):
        return None
    c = choices[0]
    text = (c.get("delta") or {}).get("content") if kind == "chat" else c.get("text")
    return text if isinstance(text, str) and text else None


def _error_event(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "code": "upstream_error"}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
