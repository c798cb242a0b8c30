"""Prefill/decode disaggregation: one request, two engines, SGLang's protocol.

The gateway picks a prefill engine (by the routing policy: prefix hits live on prefill
engines) and a decode engine (the least loaded), and sends the same request to both with
`bootstrap_host` (the prefill engine's address), `bootstrap_port` (its
`--disaggregation-bootstrap-port`) and `bootstrap_room` (a random 63-bit number naming the KV
hand-off) — what SGLang's router sends. The client reads the decode engine's answer; the
prefill engine's is read and dropped.

A request is never sent to half a pair, and a pair that fails before the decode engine
answers is replaced: a prefill engine that cannot be reached or answers 5xx before the decode
engine has answered gets its decode request cancelled (the decode engine aborts it) and both
are tried again elsewhere, as a decode engine's own refusal is. Once the decode engine has
answered, the answer is the decode engine's: its failures are handled as any engine's
(an error event, billing from the counts it gave).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp
import msgspec

from kvfleet_gateway.backends import Backend, BackendPool
from kvfleet_gateway.config import PoolConfig, PrefillBackends
from kvfleet_gateway.discovery import PodDiscovery, kube_access
from kvfleet_gateway.errors import GatewayError
from kvfleet_gateway.exchange import Exchange
from kvfleet_gateway.routing import Policy

if TYPE_CHECKING:
    from kvfleet_gateway.proxy import Proxy

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


@dataclass
class PrefillSide:
    """The prefill pool of a disaggregated service, and how its engines are chosen."""

    pool: BackendPool
    policy: Policy
    spec: PrefillBackends


def with_bootstrap(wire: bytes, host: str, port: int, room: int) -> bytes:
    """The request body with SGLang's PD fields added."""
    body = _decode(wire)
    body.update(bootstrap_host=host, bootstrap_port=port, bootstrap_room=room)
    return bytes(_encode(body))


def bootstrap_host(url: str) -> str:
    return urlsplit(url).hostname or url


class PrefillFailed(Exception):
    """The prefill engine could not take its half of the request."""


async def _prefill(proxy: Proxy, backend: Backend, path: str, wire: bytes) -> None:
    """Send the prefill half and read its (dropped) answer; raises PrefillFailed when the
    engine was not reached or refused it with a 5xx."""
    try:
        async with proxy.session.post(f"{backend.url}{path}", data=wire, headers=HEADERS) as r:
            if r.status >= 500:
                proxy.metrics.upstream_errors.labels(backend.url, f"http_{r.status}").inc()
                backend.breaker.failure()
                raise PrefillFailed(f"prefill engine answered {r.status}")
            await r.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        proxy.metrics.upstream_errors.labels(backend.url, "connect").inc()
        backend.breaker.failure()
        raise PrefillFailed(f"prefill engine: {type(exc).__name__}") from None
    backend.breaker.success()


HEADERS = {"Content-Type": "application/json"}


def _choose(policy: Policy, ex: Exchange, backends: list[Backend], pool: BackendPool) -> Backend:
    now = time.monotonic()
    key = policy.choose(ex.route, [b.candidate(now) for b in backends])
    return pool.backends[key]


def _release_prefill(
    proxy: Proxy, side: PrefillSide, ex: Exchange, backend: Backend
) -> Callable[..., None]:
    def done(task: asyncio.Task[None]) -> None:
        proxy.not_in_flight(backend, ex)
        side.policy.on_finished(ex.route, backend.url)
        if not task.cancelled():
            task.exception()  # retrieved: a late prefill failure is the decode engine's to report

    return done


async def open_disaggregated(
    proxy: Proxy, side: PrefillSide, ex: Exchange, path: str, max_attempts: int
) -> tuple[Backend, aiohttp.ClientResponse]:
    """Choose a prefill and a decode engine, send both halves; retry a failed pair before
    the decode engine answers. Returns the decode engine and its response."""
    req = ex.req
    tried_decode: set[str] = set()
    tried_prefill: set[str] = set()
    last_error = "no healthy engine pair serves this model"
    for attempt in range(max_attempts):
        model = ex.route.model
        decodes = [b for b in proxy.pool.routable(model) if b.url not in tried_decode]
        if not decodes and proxy.pool.worth_holding(model):
            decodes = await proxy.wait_for_capacity(model, tried=tried_decode)
        prefills = [b for b in side.pool.routable(model) if b.url not in tried_prefill]
        if decodes and not prefills and side.pool.worth_holding(model):
            # The prefill pool's engines are all new (a rollout replaced them, or it scales
            # from zero): worth waiting for, as for the decode pool.
            prefills = await proxy.wait_for_capacity(model, side.pool, tried_prefill)
        if not decodes or not prefills:
            if not prefills:
                last_error = "no prefill engine is available"
            break
        if attempt:
            await asyncio.sleep(proxy.retry_backoff(attempt))
        prefill = _choose(side.policy, ex, prefills, side.pool)
        decode = _choose(proxy.policy, ex, decodes, proxy.pool)
        room = random.getrandbits(63)
        port = side.spec.bootstrap_port_of(prefill.url)
        wire = with_bootstrap(req.wire, bootstrap_host(prefill.url), port, room)
        for b in (prefill, decode):
            b.breaker.attempt()
            proxy.in_flight(b, ex)
        ex.dispatched_at = time.monotonic()
        ex.deadline = ex.dispatched_at + proxy.response_wait(ex)
        prefill_task = asyncio.create_task(_prefill(proxy, prefill, path, wire))
        prefill_task.add_done_callback(_release_prefill(proxy, side, ex, prefill))
        decode_task = asyncio.create_task(
            proxy.session.post(f"{decode.url}{path}", data=wire, headers=HEADERS)
        )
        outcome = await _first_outcome(proxy, ex, prefill_task, decode_task)
        if isinstance(outcome, PrefillFailed):
            tried_prefill.add(prefill.url)
            proxy.not_in_flight(decode, ex)
            last_error = str(outcome)
            continue
        if isinstance(outcome, aiohttp.ClientResponse) and outcome.status < 500:
            decode.breaker.success()
            ex.engine_accepted = outcome.status < 400
            return decode, outcome
        # The decode engine was not reached, or refused: cancel the prefill half too.
        prefill_task.cancel()
        tried_decode.add(decode.url)
        proxy.not_in_flight(decode, ex)
        if isinstance(outcome, aiohttp.ClientResponse):
            proxy.metrics.upstream_errors.labels(decode.url, f"http_{outcome.status}").inc()
            decode.breaker.failure()
            outcome.release()
            last_error = f"decode engine answered {outcome.status}"
            continue
        if isinstance(outcome, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
            proxy.metrics.upstream_errors.labels(decode.url, "connect").inc()
            decode.breaker.failure()
            last_error = "decode engine connect error"
            continue
        proxy.policy.on_finished(ex.route, decode.url)
        raise proxy.sent_and_lost(ex, decode, outcome)
    proxy.policy.on_finished(ex.route, "")
    raise GatewayError(
        503 if not tried_decode and not tried_prefill else 502,
        f"no engine pair could take the request ({last_error})",
        "server_error",
        "upstream_unavailable",
    )


async def _first_outcome(
    proxy: Proxy,
    ex: Exchange,
    prefill: asyncio.Task[None],
    decode: asyncio.Task[aiohttp.ClientResponse],
) -> aiohttp.ClientResponse | PrefillFailed | Exception:
    """The decode engine's response, unless the prefill half fails before it comes (then
    the decode request is cancelled: its engine sees the connection close and aborts)."""
    try:
        async with asyncio.timeout_at(proxy.loop_deadline(ex)):
            pending: set[asyncio.Task[object]] = {prefill, decode}
            while decode in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if prefill in done and not prefill.cancelled() and prefill.exception():
                    decode.cancel()
                    with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                        (await decode).close()
                    failure = prefill.exception()
                    assert isinstance(failure, PrefillFailed)
                    return failure
            return decode.result()
    except Exception as exc:  # the caller sorts connect errors from the rest
        if not decode.done():
            decode.cancel()
        return exc


def prefill_side(config: PoolConfig, health_interval: float, policy: Policy) -> PrefillSide | None:
    """The prefill pool the config names (None: a colocated service)."""
    spec = config.backends.prefill
    if spec is None:
        return None
    urls = [e.url for e in spec.static]
    pool = BackendPool(urls, health_interval, config.routing.scrape_interval)
    pool.removed_hook = policy.on_removed
    return PrefillSide(pool, policy, spec)


@contextlib.asynccontextmanager
async def prefill_pool_running(
    side: PrefillSide | None, config: PoolConfig, session: aiohttp.ClientSession
) -> AsyncIterator[None]:
    """Health checks, signals and (with a selector) pod discovery of the prefill pool."""
    spec = config.backends.prefill
    if side is None or spec is None:
        yield
        return
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(side.pool.running(session))
        if spec.kubernetes is not None:
            static = {e.url for e in spec.static}
            finder = PodDiscovery(
                kube_access(spec.kubernetes.kubeconfig),
                spec.kubernetes,
                lambda urls: side.pool.set_members(static | urls),
            )
            await stack.enter_async_context(finder.running())
        yield
