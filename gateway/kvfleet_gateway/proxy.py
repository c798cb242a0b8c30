"""Forward one admitted request to an engine and the answer back, as it arrives.

Streams are relayed event by event (SSE events end with a blank line): an event is written
to the client the moment its last byte arrives from the engine. The gateway reads usage from
the engine's stream (it always asks for it) and drops the usage-only chunk when the client
did not ask for it. A request that fails before any byte reached the client is retried once
on another replica; after that, failures end the stream with an error event.

What an engine sends is not trusted: usage is clamped to what admission reserved (never
negative, never beyond the bound), an SSE event or a response body larger than a cap is cut
with a 502 or an error event, a body that is not JSON is a 502, and a stream that ends without
`data: [DONE]` ends with an error event, so a client can tell a cut answer from a whole one.

Timeouts, each counted against the party that caused it: a stream has `first_byte` until the
engine's first chunk, then `idle` between chunks (an engine that stops talking — SIGSTOP, a
hung GPU — is an upstream timeout); a non-streaming request, which an engine answers only
once its whole reply is generated, has one deadline for the whole response (`firstByte +
max_tokens / minDecodeRate`, capped by `wholeResponse`); `client_write` for a client that stops
reading (counted as the client's, status 499, not as an engine failure).

A request is retried on another replica only when no engine took it: the connection could not
be made, or the engine refused it with an error status before replying. Once sent and not
refused, the engine may be doing the work (a timeout, a dropped connection), and a retry
would do it twice.
An accepted request that times out is a 504 billed at its reservation's bound (the engine gave
no counts) and is not a breaker failure: slowness of accepted work is not a broken replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import aiohttp
import msgspec
from aiohttp import web

from kvfleet_gateway import engine_replies as replies
from kvfleet_gateway.backends import Backend, BackendPool
from kvfleet_gateway.config import Hold, Timeouts
from kvfleet_gateway.disaggregation import PrefillSide, open_disaggregated
from kvfleet_gateway.errors import GatewayError
from kvfleet_gateway.exchange import Exchange
from kvfleet_gateway.fairness import Saturation, with_room
from kvfleet_gateway.lora import AdapterManager
from kvfleet_gateway.metrics import GatewayMetrics
from kvfleet_gateway.routing import Policy
from kvfleet_gateway.routing.kvfleet import KvfleetPolicy

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "generate": "/generate"}
MAX_ATTEMPTS = 3
"""Tries before the first byte (each on a different replica)."""
RETRY_BACKOFF_S = 0.05
"""Pause before the second try, doubled before each later one."""
HOLD_POLL_S = 0.2
"""How often a held request looks for a replica again."""
MAX_SSE_EVENT_BYTES = 1 << 20
"""An upstream SSE event (or unterminated line) larger than this ends the stream."""
MAX_UPSTREAM_BODY_BYTES = 64 << 20
"""A non-streaming engine response larger than this is a 502."""
USAGE_DRAIN_S = 0.5
"""After a client leaves mid-stream, how long the gateway keeps reading the engine's chunks
for its latest token counts before it cuts the connection (the engine then aborts)."""
JSON_HEADERS = {"Content-Type": "application/json"}
CLIENT_GONE: tuple[type[Exception], ...] = (OSError, aiohttp.ClientConnectionError)
"""What a write to a client that left raises: aiohttp's ClientConnectionResetError, the
ConnectionError('Connection lost') of a paused writer whose peer reset, a broken pipe, a
write timeout (TimeoutError is an OSError). Each ends the stream as "client gone"."""
DONE = b"data: [DONE]"
log = logging.getLogger("kvfleet.gateway")
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


@dataclass
class Proxy:
    session: aiohttp.ClientSession
    pool: BackendPool
    policy: Policy
    timeouts: Timeouts
    metrics: GatewayMetrics
    hold: Hold = field(default_factory=Hold)
    prefill: PrefillSide | None = None
    """Disaggregated serving: the prefill pool (`pool` is then the decode pool)."""
    saturation: Saturation | None = None
    """Fairness on: a replica at its slot bound gets nothing while another has room."""
    lora: AdapterManager | None = None
    """LoRA: replicas holding a request's adapter first; one loads it when none does."""
    _held: int = 0
    retired: bool = False
    """Its pool was replaced or removed and has stopped: a request it still holds would wait
    for replicas nobody discovers any more."""

    @property
    def held(self) -> int:
        """Requests waiting in `wait_for_capacity` now."""
        return self._held

    async def wait_for_capacity(
        self, model: str, pool: BackendPool | None = None, tried: Collection[str] = ()
    ) -> list[Backend]:
        """No replica of `model` exists in `pool` (default: the engines; a disaggregated
        service's prefill pool too) that the request has not `tried` — scaled to zero, or all
        starting: hold the request (bounded in number and time) until one can take it — the
        autoscaler sees the held count and wakes one."""
        pool = self.pool if pool is None else pool
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
            while time.monotonic() < deadline and not self.retired:
                candidates = [b for b in pool.routable(model) if b.url not in tried]
                if candidates:
                    return candidates
                await asyncio.sleep(HOLD_POLL_S)
            if self.retired:
                raise GatewayError(
                    503,
                    f"the replicas of '{model}' changed while this request waited; retry",
                    "server_error",
                    "no_capacity",
                    headers={"Retry-After": "1"},
                )
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
        if self.prefill is not None:
            return await open_disaggregated(self, self.prefill, ex, PATHS[req.kind], MAX_ATTEMPTS)
        tried: set[str] = set()
        last_error = "no healthy backend serves this model"
        for attempt in range(MAX_ATTEMPTS):
            model = ex.route.model
            candidates = [b for b in self.pool.routable(model) if b.url not in tried]
            if not candidates and self.pool.worth_holding(model):
                candidates = await self.wait_for_capacity(model, tried=tried)
            if ex.adapter is not None and self.lora is not None:
                candidates = self.lora.offered(candidates, ex.adapter)
            if not candidates:
                break
            if attempt:
                await asyncio.sleep(self.retry_backoff(attempt))
            now = time.monotonic()
            offered = [b.candidate(now) for b in candidates]
            if self.saturation is not None:
                offered = with_room(offered, self.saturation)
            key = self.policy.choose(ex.route, offered)
            backend = self.pool.backends[key]
            tried.add(key)
            if ex.adapter is not None and self.lora is not None:
                try:
                    if await self.lora.ensure(self.session, backend, ex.adapter, model, ex.tenant):
                        ex.load_charge = self.lora.config.load_charge_tokens
                except GatewayError:
                    self.policy.on_finished(ex.route, backend.url)  # the placement is void
                    raise
            backend.breaker.attempt()
            # In flight from the moment it is chosen: routing must see requests whose
            # response has not started yet (a non-streaming answer arrives all at once).
            self.in_flight(backend, ex)
            ex.dispatched_at = time.monotonic()
            ex.deadline = ex.dispatched_at + self.response_wait(ex)
            try:
                async with asyncio.timeout_at(self.loop_deadline(ex)):
                    resp = await self.session.post(
                        f"{backend.url}{PATHS[req.kind]}", data=req.wire, headers=JSON_HEADERS
                    )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
                # Never reached the engine: safe to try another replica.
                self.metrics.upstream_errors.labels(backend.url, "connect").inc()
                backend.breaker.failure()
                self.not_in_flight(backend, ex)
                last_error = "engine connect error"
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.not_in_flight(backend, ex)
                self.policy.on_finished(ex.route, backend.url)
                raise self.sent_and_lost(ex, backend, exc) from None
            if resp.status >= 500:
                # The engine refused it (an error status, not a reply): it did not take the
                # work, so another replica may, before any byte reached the client.
                self.metrics.upstream_errors.labels(backend.url, f"http_{resp.status}").inc()
                backend.breaker.failure()
                self.not_in_flight(backend, ex)
                resp.release()
                last_error = f"engine answered {resp.status}"
                continue
            backend.breaker.success()
            ex.engine_accepted = resp.status < 400
            return backend, resp
        self.policy.on_finished(ex.route, "")
        raise GatewayError(
            503 if not tried else 502,
            f"no engine could take the request ({last_error})",
            "server_error",
            "upstream_unavailable",
        )

    @staticmethod
    def retry_backoff(attempt: int) -> float:
        return float(RETRY_BACKOFF_S * 2 ** (attempt - 1))

    def response_wait(self, ex: Exchange) -> float:
        """How long a request may wait for its response to begin: a stream, its first byte;
        a non-streaming request, its whole reply."""
        t = self.timeouts
        if ex.req.stream:
            return float(t.first_byte)
        return min(float(t.whole_response), t.first_byte + ex.req.max_tokens / t.min_decode_rate)

    @staticmethod
    def loop_deadline(ex: Exchange) -> float:
        """`ex.deadline` (monotonic) on the event loop's clock."""
        loop = asyncio.get_running_loop()
        return loop.time() + (ex.deadline - time.monotonic())

    def sent_and_lost(self, ex: Exchange, backend: Backend, exc: Exception) -> GatewayError:
        """The request reached the engine, then its answer did not come: not retried (the
        engine may be doing the work), billed as accepted; a timeout is not a breaker failure."""
        ex.backend = backend
        ex.engine_accepted = True
        if isinstance(exc, TimeoutError):
            self.metrics.upstream_errors.labels(backend.url, "timeout").inc()
            backend.breaker.inconclusive()
            ex.status = 504
            return GatewayError(
                504,
                "the engine did not answer in time"
                + ("" if ex.req.stream else " (a non-streaming reply: try stream=true)"),
                "server_error",
                "upstream_timeout",
            )
        self.metrics.upstream_errors.labels(backend.url, "lost").inc()
        backend.breaker.failure()
        ex.status = 502
        return GatewayError(
            502, "the engine dropped the connection", "server_error", "upstream_error"
        )

    def _report_timing(self, ex: Exchange, key: str) -> None:
        """A streamed answer's timing, for the policy's calibration: dispatch to first token,
        then the mean time per token (a whole response arrives at once: nothing to time)."""
        if not ex.req.stream or ex.first_token_at is None or ex.status >= 400:
            return
        tokens = ex.usage.completion_tokens if ex.usage is not None else ex.content_chunks
        itl = None
        if tokens > 1 and ex.last_token_at is not None:
            itl = (ex.last_token_at - ex.first_token_at) / (tokens - 1)
        self.policy.observe(ex.route, key, ex.first_token_at - ex.dispatched_at, itl)
        if isinstance(self.policy, KvfleetPolicy):
            # Each pool's policy calibrates on its own model's replicas: one series per model.
            self.metrics.calibrated_prefill.labels(ex.route.model).set(self.policy.prefill_rate)
            self.metrics.calibrated_step.labels(ex.route.model).set(self.policy.step_scale)

    def _report_work(self, ex: Exchange, backend: Backend) -> None:
        """A finished request's usage, for the policy's request mix, and the throughput of a
        replica like the one that served it (its KV pool) at that mix. Not for a disaggregated
        pool: its replicas do only half of each request."""
        if not isinstance(self.policy, KvfleetPolicy) or self.prefill is not None:
            return
        if ex.usage is None or ex.status >= 400:
            return
        u = ex.usage
        self.policy.observe_work(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
        pool = backend.signals.max_total_tokens if backend.signals is not None else 0
        throughput = self.policy.throughput(pool)
        if throughput is not None:
            self.metrics.replica_throughput.labels(ex.route.model).set(throughput)

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
            self._report_timing(ex, backend.url)
            self._report_work(ex, backend)
            self.policy.on_finished(ex.route, backend.url)
            self.not_in_flight(backend, ex)

    async def _error_passthrough(
        self, ex: Exchange, upstream: aiohttp.ClientResponse, headers: dict[str, str]
    ) -> web.Response:
        raw = await self._read_body(ex, upstream)
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

    async def _read_body(self, ex: Exchange, upstream: aiohttp.ClientResponse) -> bytes:
        """The whole upstream body, capped and timed; a failure is the engine's (502)."""
        kind, why = "response", "body larger than the gateway's cap"
        try:
            # Within the request's deadline, and at least `idle` to read what has begun.
            wait = max(ex.deadline - time.monotonic(), float(self.timeouts.idle))
            async with asyncio.timeout(wait):
                chunks, size = [], 0
                async for chunk in upstream.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > MAX_UPSTREAM_BODY_BYTES:
                        break
                    chunks.append(chunk)
                else:
                    return b"".join(chunks)
        except TimeoutError:
            kind, why = "timeout", "the engine did not finish its response in time"
        except aiohttp.ClientError:
            kind, why = "truncated", "the engine's response was cut short"
        self._upstream_failed(ex, kind)
        raise GatewayError(502, f"bad engine response: {why}", "server_error", "upstream_error")

    async def _whole(
        self, ex: Exchange, upstream: aiohttp.ClientResponse, headers: dict[str, str]
    ) -> web.Response:
        raw = await self._read_body(ex, upstream)
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            self._upstream_failed(ex, "malformed")
            raise GatewayError(
                502, "bad engine response: not a JSON object", "server_error", "upstream_error"
            )
        ex.status = upstream.status
        ex.token_arrived()
        ex.usage = replies.usage(ex.req.kind, payload)
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
        try:
            await resp.prepare(request)  # rate-limit headers reach the client before any token
        except CLIENT_GONE:  # it left before its first byte: the engine aborts
            log.info("client of %s left before its first byte: status 499", ex.tenant)
            ex.client_gone, ex.status = True, 499
            return resp
        ex.status = 200
        t = self.timeouts
        itl = self.metrics.itl.labels(ex.tenant, ex.req.model)
        buffer = b""
        ended = False  # the engine's [DONE] arrived
        failure: str | None = None
        # SGLang sends its first event (the role chunk) once prefill has produced a token, so
        # any byte ends the first_byte wait — even when that token's text is still held back.
        heard = False
        try:
            while not ended:
                try:
                    wait = t.idle if heard else t.first_byte
                    async with asyncio.timeout(wait):
                        data = await upstream.content.readany()
                except TimeoutError:
                    failure = self._upstream_failed(ex, "timeout", "engine timeout mid-stream")
                    break
                except aiohttp.ClientError:
                    failure = self._upstream_failed(ex, "stream", "engine stream error mid-stream")
                    break
                if not data:
                    break
                heard = True
                events, buffer = replies.split_events(buffer + data)
                ready: list[bytes] = []
                for event in events:
                    if event.startswith(DONE):
                        ended = True
                    out = self._observe(ex, event)
                    if out:
                        ready.append(out)
                        if ex.content_chunks > 1 and ex.last_token_at is not None:
                            itl.observe(ex.last_token_at - ex.prev_token_at)
                if len(buffer) > MAX_SSE_EVENT_BYTES:
                    failure = self._upstream_failed(
                        ex, "oversized_event", "the engine sent an oversized stream event"
                    )
                    break
                if ready:  # events that arrived together leave together: one write
                    try:
                        async with asyncio.timeout(t.client_write):
                            await resp.write(ready[0] if len(ready) == 1 else b"".join(ready))
                    except TimeoutError:
                        # The client stopped reading: its doing, not the engine's.
                        log.info("client of %s stopped reading; cutting its stream", ex.tenant)
                        ex.client_gone, ex.status = True, 499
                        break
            if failure is None and not ended and not ex.client_gone:
                failure = self._upstream_failed(
                    ex, "incomplete", "the engine ended the stream without [DONE]"
                )
            if failure is not None:
                async with asyncio.timeout(t.client_write):
                    await resp.write(replies.error_event(failure))
        except CLIENT_GONE:
            ex.client_gone = True  # client hung up: stop writing, the engine aborts
            ex.status = 499
        except Exception:
            # A bug while relaying: the headers are sent, so no error response can follow;
            # the client must still see the stream end with an error, not hang.
            log.exception("relaying a stream failed for tenant %s", ex.tenant)
            ex.status = 500
            with contextlib.suppress(*CLIENT_GONE):
                async with asyncio.timeout(t.client_write):
                    await resp.write(replies.error_event("internal error in the gateway"))
        if ex.client_gone and not ended:
            await self._drain_usage(ex, upstream, buffer)
        if ex.usage is None and ex.last_event:
            self._observe(ex, ex.last_event, final=True)
        if not ex.client_gone:
            with contextlib.suppress(*CLIENT_GONE):
                await resp.write_eof()
        return resp

    async def _drain_usage(
        self, ex: Exchange, upstream: aiohttp.ClientResponse, buffer: bytes
    ) -> None:
        """Read what the engine already sent (briefly) for its latest token counts, so a
        client that leaves is billed the engine's work rather than what it read."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + USAGE_DRAIN_S
        with contextlib.suppress(TimeoutError, aiohttp.ClientError):
            async with asyncio.timeout_at(deadline):
                while len(buffer) <= MAX_SSE_EVENT_BYTES:
                    events, buffer = replies.split_events(buffer)
                    for event in events:
                        if event.startswith(DONE):
                            return
                        self._observe(ex, event)
                    data = await upstream.content.readany()
                    if not data:
                        return
                    buffer += data

    def in_flight(self, backend: Backend, ex: Exchange) -> None:
        backend.inflight_requests += 1
        backend.inflight_tokens += ex.req.reserve_tokens
        if ex.adapter is not None and self.lora is not None:
            self.lora.started(backend, ex.adapter)

    def not_in_flight(self, backend: Backend, ex: Exchange) -> None:
        backend.inflight_requests -= 1
        backend.finished_requests += 1
        backend.inflight_tokens -= ex.req.reserve_tokens
        if ex.adapter is not None and self.lora is not None:
            self.lora.ended(backend, ex.adapter)

    def _upstream_failed(self, ex: Exchange, kind: str, why: str = "") -> str:
        assert ex.backend is not None
        self.metrics.upstream_errors.labels(ex.backend.url, kind).inc()
        ex.status = 502
        return why

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
            payload = _decode(event[6:])  # every chunk: msgspec, several times json's speed
        except msgspec.DecodeError:
            return event
        if not isinstance(payload, dict):
            return event
        usage = replies.usage(kind, payload)
        if usage is not None:
            ex.usage = usage
        content = replies.content(kind, payload)
        if content is not None and not final:
            ex.token_arrived()
            ex.content_chars += len(content)
        if usage is None or kind == "generate":
            return event
        if not payload.get("choices"):
            # The final usage-only chunk: the client gets it if it asked for usage.
            return event if ex.req.client_wants_usage else None
        if ex.req.client_wants_continuous_usage:
            return event
        # The gateway asked for usage in every chunk (to bill cut streams); the client did
        # not: some clients add up every usage they see.
        del payload["usage"]
        return b"data: " + _encode(payload) + b"\n\n"
