"""The gateway's aiohttp application: auth, admission, proxying, accounting, observability.

One request, in order: authenticate the key → read, validate and bound the body (all input
errors are 4xx here, before anything is charged) → reserve (prompt bound + max_tokens)
against the tenant's limits → proxy to a replica inside `accounting.Admitted`, which settles
to the engine's real usage exactly once, whatever ends the request → metrics and one JSON
access-log line.

`/metrics` is served on its own port (`listen.metricsPort`): it names tenants, budgets, costs
and backend addresses, which API clients have no business reading.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvfleet_gateway import inbound, isolation
from kvfleet_gateway.accounting import Admitted
from kvfleet_gateway.backends import read_secret_file
from kvfleet_gateway.config import GatewayConfig, Limits
from kvfleet_gateway.errors import ClientGone, GatewayError
from kvfleet_gateway.exchange import Exchange
from kvfleet_gateway.keys import KeyWatcher, Tenant
from kvfleet_gateway.kv_events.hashing import page_hashes
from kvfleet_gateway.limiter import (
    COST_UNIT,
    Decision,
    LimitStore,
    MemoryStore,
    Quota,
    Ticket,
    cost_units,
)
from kvfleet_gateway.lora import Target
from kvfleet_gateway.metrics import GatewayMetrics
from kvfleet_gateway.pools import ModelPool, PoolSet
from kvfleet_gateway.pre_admission import PreAdmission
from kvfleet_gateway.probes import healthz, make_metrics_app, readyz
from kvfleet_gateway.redis_store import RedisStore
from kvfleet_gateway.routing.base import RouteRequest
from kvfleet_gateway.routing.blocks import BLOCK_TOKENS, text_blocks
from kvfleet_gateway.state import ANONYMOUS, GATEWAY, Gateway

log = logging.getLogger("kvfleet.gateway")

# ---- helpers -----------------------------------------------------------------------------


def _fmt_reset(seconds: float) -> str:
    """OpenAI's reset format: 1s, 6m0s, 1h2m3s."""
    s = max(0, math.ceil(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{sec}s"


def ratelimit_headers(q: Quota) -> dict[str, str]:
    h: dict[str, str] = {}
    if q.limit_requests is not None:
        h["x-ratelimit-limit-requests"] = str(q.limit_requests)
        h["x-ratelimit-remaining-requests"] = str(q.remaining_requests)
        h["x-ratelimit-reset-requests"] = _fmt_reset(q.reset_requests_s)
    if q.limit_tokens is not None:
        h["x-ratelimit-limit-tokens"] = str(q.limit_tokens)
        h["x-ratelimit-remaining-tokens"] = str(q.remaining_tokens)
        h["x-ratelimit-reset-tokens"] = _fmt_reset(q.reset_tokens_s)
    if q.budget is not None and q.budget.unit == "cost":
        h["x-kvfleet-budget-remaining-cost"] = f"{q.budget.left * COST_UNIT:.6f}"
        h["x-kvfleet-budget-reserved-cost"] = f"{q.budget.reserved * COST_UNIT:.6f}"
    elif q.budget is not None:
        h["x-kvfleet-budget-remaining-tokens"] = str(q.budget.left)
        h["x-kvfleet-budget-reserved-tokens"] = str(q.budget.reserved)
    if q.budget is not None and q.budget.resets_at is not None:
        # Unix seconds: a client can tell which period a request was billed to.
        h["x-kvfleet-budget-resets-at"] = str(math.ceil(q.budget.resets_at))
    return h


def rejection(d: Decision) -> GatewayError:
    if d.reason in ("store_unavailable", "store_reset"):
        return GatewayError(503, d.message, "server_error", "limits_unavailable")
    if d.reason == "budget":
        return GatewayError(429, d.message, "tokens", "insufficient_quota")
    kind = "tokens" if d.reason == "tokens" else "requests"
    return GatewayError(429, d.message, kind, "rate_limit_exceeded")


def _key_error(message: str) -> GatewayError:
    return GatewayError(401, message, "invalid_request_error", "invalid_api_key")


AUTH_SCHEMES = frozenset({"basic", "digest", "token", "apikey", "negotiate", "hoba", "mutual"})
"""Schemes named back in an error (anything else may be a key sent without a scheme)."""


def _wrong_scheme(scheme: str) -> str:
    named = f"'{scheme}'" if scheme.lower() in AUTH_SCHEMES else "another"
    return (
        f"the Authorization header uses the {named} scheme; this gateway takes API keys as"
        " 'Authorization: Bearer <key>'"
    )


def authenticate(gw: Gateway, request: web.Request) -> Tenant:
    """The tenant of the request's key. Nothing about a presented key — not a byte of it —
    reaches an error body or a log line, however malformed it is."""
    if gw.keys is None:
        return ANONYMOUS
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if header.strip() and scheme.lower() != "bearer":
        raise _key_error(_wrong_scheme(scheme))
    if not key:
        raise _key_error("missing API key: send 'Authorization: Bearer <key>'")
    if not (key.isascii() and key.isprintable()):
        raise _key_error("invalid API key")  # keys are printable ASCII; hashing needs no more
    tenant = gw.keys.ring.authenticate(key)
    if tenant is None:
        raise _key_error("invalid API key")
    return tenant


def _before_the_body(
    gw: Gateway, request: web.Request, tenant: str, limits: Limits
) -> web.Response | None:
    """What can be refused from the headers alone (`pre_admission`), before a byte of the
    body is read: a refusal that stands, concurrency, the tenant's share of parsing, and
    compressed bodies where they are not accepted."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity") and not gw.config.requests.compressed_bodies:
        raise GatewayError(
            415,
            f"request bodies with Content-Encoding {encoding!r} are not accepted here "
            "(requests.compressedBodies)",
            code="unsupported_media_type",
        )
    now = time.time()
    standing = gw.pre.refusal(tenant, limits, now)
    if standing is not None:
        decision = standing.decision
        headers = ratelimit_headers(decision.quota)
        headers["Retry-After"] = str(max(1, math.ceil(standing.until - now)))
        gw.metrics.rejections.labels(tenant, decision.reason or "unknown").inc()
        return rejection(decision).response(headers)
    err = gw.pre.over_concurrency(tenant, limits)
    err = err or gw.pre.take_body(tenant, request.content_length or 0, now)
    if err is not None:
        gw.metrics.rejections.labels(tenant, "requests").inc()
        raise err
    return None


async def _read_json(gw: Gateway, request: web.Request, tenant: str) -> dict[str, Any]:
    try:
        async with asyncio.timeout(gw.config.timeouts.client_body):
            raw = await request.read()
    except (ConnectionResetError, aiohttp.ClientPayloadError):
        raise ClientGone(tenant, "while sending its request body") from None
    except web.HTTPRequestEntityTooLarge:
        raise GatewayError(
            413,
            f"request body larger than {gw.config.max_body_bytes} bytes",
            code="request_too_large",
        ) from None
    except TimeoutError:
        raise GatewayError(
            408, "the request body took too long to arrive", code="request_timeout"
        ) from None
    if request.content_length is None:  # chunked: charged as read
        err = gw.pre.take_body(tenant, len(raw), time.time())
        if err is not None:
            raise err
    return inbound.decode(raw, gw.config.requests.max_json_containers)


# ---- handlers ----------------------------------------------------------------------------


def _allowed(limits: Limits, *names: str | None) -> bool:
    return limits.models is None or any(n in limits.models for n in names if n)


async def list_models(request: web.Request) -> web.Response:
    """Every model, alias and adapter of every pool the key may use."""
    gw = request.app[GATEWAY]
    tenant = authenticate(gw, request)
    limits = gw.config.limits_for(tenant.name, tenant.limits)
    data: list[dict[str, Any]] = []
    for pool, name, ctx in gw.pools.served():
        model = pool.models.get(name)
        entry = {"object": "model", "created": 0,
                 "owned_by": model.owned_by if model else "kvfleet",
                 **({"max_model_len": ctx} if ctx else {})}  # fmt: skip
        aliases = model.aliases if model else ()
        for n in (name, *aliases):
            if _allowed(limits, n, name, *aliases):
                data.append({"id": n, **entry, **({"root": name} if n != name else {})})
        for adapter, base in sorted(pool.adapters().items()):
            if base == name and _allowed(limits, adapter):
                data.append({"id": adapter, **entry, "parent": base, "root": base})
    return web.json_response({"object": "list", "data": data})


def _pool_for(gw: Gateway, kind: inbound.Kind, body: dict[str, Any]
              ) -> tuple[ModelPool | None, Target | None, int | None]:  # fmt: skip
    """The pool serving the body's `model`, what it names there and the base model's
    context length (None: no pool serves it). An alias or adapter reaches the engines in
    their own names (`<base>:<adapter>`)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        only = gw.pools.only()
        served = only.served() if only is not None else {}
        if len(served) != 1:
            return only, None, None
        ((name, context),) = served.items()
        return only, Target(name), context
    found = gw.pools.find(model)
    if found is None:
        return None, None, None
    pool, target, context = found
    if target.adapter is not None and kind == "generate":
        raise GatewayError(400, "LoRA adapters are served on /v1/chat/completions and"
                           " /v1/completions", param="model")  # fmt: skip
    body["model"] = target.engine_model
    return pool, target, context


def _check_allowed(
    limits: Limits, asked: str, pool: ModelPool, target: Target, param: str = "model"
) -> None:
    """A tenant's `models` allow-list: the name it sent, or the model it names (an alias
    of an allowed model is allowed; an adapter must be listed itself)."""
    if target.adapter is not None:
        names: tuple[str, ...] = (target.adapter,)
    else:
        model = pool.models.get(target.base)
        names = (target.base, *(model.aliases if model else ()))
    if not _allowed(limits, asked, *names):
        raise GatewayError(403, f"the model '{asked}' is not available to this API key",
                           "permission_error", "model_not_allowed", param)  # fmt: skip


def _adapter_of(lora_path: str, target: Target) -> Target:
    """What `lora_path` names, for the allow-list: `<adapter>` or `<base>:<adapter>` of the
    request's base model — always an adapter, listed in `models` by its own name."""
    base, sep, name = lora_path.rpartition(":")
    return Target(target.base, name if sep and base == target.base else lora_path)


def _no_such_model(gw: Gateway, model: str) -> NoReturn:
    if not gw.pools.served():
        log.warning("no healthy backend: no replica answers /v1/models (is any running?)")
        raise GatewayError(503, "no healthy backend: no engine replica is available",
                           "server_error", "no_healthy_backend")  # fmt: skip
    raise GatewayError(404, f"the model '{model}' does not exist", "invalid_request_error",
                       "model_not_found", "model")  # fmt: skip


LONG_PROMPT_CHARS = 16_384
"""Prompts longer than this are tokenized off the event loop (about a millisecond or more)."""


async def _engine_pages(
    pool: ModelPool, req: inbound.ClientRequest, salt: str | None
) -> tuple[tuple[int, ...], int, int | None]:
    """The prompt's page hashes as the engines publish them, their page size, and the exact
    prompt length; nothing when no engine stream is live or the prompt cannot be reproduced."""
    ep, prompts = req.engine_prompt, pool.prompts
    size = pool.events.block_size() if pool.events is not None else None
    if prompts is None or ep is None or size is None:
        return (), 0, None
    ids = (
        await asyncio.to_thread(prompts.ids_of, ep)
        if ep.chars > LONG_PROMPT_CHARS
        else prompts.ids_of(ep)
    )
    if ids is None:
        return (), 0, None
    try:
        return page_hashes(ids, size, salt), size, len(ids)
    except OverflowError:  # an id beyond uint32: not a real tokenizer's
        return (), 0, None


async def _generation(request: web.Request, kind: inbound.Kind) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    tenant = authenticate(gw, request)
    limits: Limits = gw.config.limits_for(tenant.name, tenant.limits)
    refused = _before_the_body(gw, request, tenant.name, limits)
    if refused is not None:
        return refused
    body = await _read_json(gw, request, tenant.name)
    salt = isolation.cache_salt(gw.config.cache_isolation, tenant.name, body.get("cache_salt"))
    if salt is None:
        body.pop("cache_salt", None)
    else:
        body["cache_salt"] = salt
    asked = body.get("model")
    pool, target, context = _pool_for(gw, kind, body)
    # OpenAI's endpoints require `model`; /generate (SGLang's, which has none) defaults to
    # the gateway's only model.
    default = kind == "generate" and target is not None and asked is None
    vocab = pool.vocab_size if pool is not None else None
    req = inbound.parse(kind, body, limits, target.base if default and target else None,
                        gw.config.requests, vocab)  # fmt: skip
    if pool is None or target is None:
        _no_such_model(gw, req.model)
    assert pool is not None and target is not None and pool.proxy is not None
    _check_allowed(limits, asked if isinstance(asked, str) else target.base, pool, target)
    if isinstance(body.get("lora_path"), str):  # parse typed it; an adapter, named otherwise
        lora = body["lora_path"]
        _check_allowed(limits, lora, pool, _adapter_of(lora, target), "lora_path")
    base = target.base
    inbound.check_context(req, context)
    pages, page_tokens, prompt_tokens = await _engine_pages(pool, req, salt)
    route = RouteRequest(
        base,
        isolation.salted_units(salt, req.prompt_text),
        text_blocks(req.prompt_text, salt=salt),
        prompt_tokens or req.estimated_prompt_tokens,
        req.max_tokens,
        block_tokens=BLOCK_TOKENS,
        pages=pages,
        page_tokens=page_tokens,
    )
    price = pool.price(base)
    # A request for an adapter may cause a load: its charge is reserved (settled if it did).
    charge = pool.config.lora.load_charge_tokens if target.adapter is not None else 0
    bound = price.bound(req.prompt_bound + charge, req.max_tokens) if price else 0.0
    # Everything above may refuse the request; nothing below may leak what admission grants.
    ticket = Ticket(
        tenant.name,
        limits,
        req.reserve_tokens + charge,
        uuid.uuid4().hex,
        time.time(),
        gw.config.limits.lease_ttl,
        budget_need=cost_units(bound) if limits.cost_budget is not None else None,
    )
    decision = await gw.store.admit(ticket)
    gw.pre.remember(tenant.name, limits, decision, time.time())
    headers = ratelimit_headers(decision.quota)
    if decision.quota.budget is not None:
        gw.metrics.set_budget(tenant.name, decision.quota.budget)
    if not decision.admitted:
        gw.metrics.rejections.labels(tenant.name, decision.reason or "unknown").inc()
        err = rejection(decision)
        if decision.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(decision.retry_after_s)))
        gw.metrics.requests.labels(tenant.name, req.model, str(err.status)).inc()
        return err.response(headers)
    assert decision.lease is not None
    ex = Exchange(tenant.name, req, route, adapter=target.adapter, price=price,
                  gpu_cost=pool.config.cost)  # fmt: skip
    gw.pre.inflight[tenant.name] += 1
    try:
        async with Admitted(gw.config, gw.store, gw.metrics, ex, decision.lease):
            try:
                async with pool.fair.slot(ex, limits):
                    return await pool.proxy.forward(request, ex, headers)
            except GatewayError as err:
                ex.status = err.status
                return err.response(headers)
    finally:
        gw.pre.inflight[tenant.name] -= 1


async def expect_after_auth(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue`: the client holds its body until told to send it, and it is
    told only once its key is good (aiohttp's default tells anyone)."""
    if request.headers.get("Expect", "").lower() != "100-continue":
        return GatewayError(417, "only 'Expect: 100-continue' is understood").response()
    try:
        authenticate(request.app[GATEWAY], request)
    except GatewayError as err:
        return err.response()
    if request.version >= aiohttp.HttpVersion11 and request.transport is not None:
        request.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return None


async def chat(request: web.Request) -> web.StreamResponse:
    return await _generation(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generation(request, "completion")


async def generate(request: web.Request) -> web.StreamResponse:
    return await _generation(request, "generate")


@web.middleware
async def errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)  # type: ignore[no-any-return]
    except GatewayError as err:
        return err.response()
    except ClientGone as gone:
        log.info("%s: status 499", gone)
        request.app[GATEWAY].metrics.requests.labels(gone.tenant, "", "499").inc()
        return web.Response(status=499)
    except web.HTTPNotFound:
        return GatewayError(404, f"no route {request.path}", code="not_found").response()
    except web.HTTPMethodNotAllowed:
        return GatewayError(405, f"{request.method} not allowed on {request.path}").response()
    except web.HTTPException:
        raise
    except Exception:
        # A bug, not the client's doing: the traceback goes to the log, never to the client.
        log.exception("internal error on %s %s", request.method, request.path)
        return GatewayError(
            500, "internal error in the gateway", "server_error", "internal_error"
        ).response()


# ---- app ---------------------------------------------------------------------------------


class RedactMalformedRequests(logging.Filter):
    """aiohttp logs a malformed request with its parser's message, which quotes the bad
    bytes — an `Authorization` header with a stray control byte put the whole API key in the
    log. Keep the event, drop the quote."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg = "refused a malformed HTTP request (%s)"
            record.args = (type(exc).__name__,)
            record.exc_info = record.exc_text = None
        return True


def _redact_server_logs() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, RedactMalformedRequests) for f in server_log.filters):
        server_log.addFilter(RedactMalformedRequests())


def make_store(config: GatewayConfig) -> LimitStore:
    if config.limits.store == "memory":
        return MemoryStore()
    lim = config.limits
    return RedisStore(
        lim.store,
        lim.redis_outage.gateway_replicas,
        settle_grace_s=lim.settle_grace,
        journal=Path(lim.journal) if lim.journal else None,
        scope=lim.scope,
        password=read_secret_file(lim.password_file, "limits.passwordFile"),
    )


def make_app(config: GatewayConfig) -> web.Application:
    if config.auth.keys_file is None and not config.auth.insecure_no_auth:
        raise ValueError("no API keys configured: give a keys file or --insecure-no-auth")
    _redact_server_logs()
    metrics = GatewayMetrics()
    gw = Gateway(
        config=config,
        keys=KeyWatcher(Path(config.auth.keys_file)) if config.auth.keys_file else None,
        store=make_store(config),
        pools=PoolSet(config, metrics),
        metrics=metrics,
        pre=PreAdmission(config.requests.body_bytes_per_second, 2.0 * config.max_body_bytes),
    )
    app = web.Application(middlewares=[errors_middleware], client_max_size=config.max_body_bytes)
    app[GATEWAY] = gw

    async def pools(app: web.Application) -> AsyncIterator[None]:
        async with gw.pools.running():
            yield

    async def key_watcher(app: web.Application) -> AsyncIterator[None]:
        if gw.keys is None:
            yield
            return
        async with gw.keys.watching():
            yield

    async def store(app: web.Application) -> AsyncIterator[None]:
        if isinstance(gw.store, RedisStore):
            async with gw.store.running():
                yield
        else:
            yield

    async def metrics_server(app: web.Application) -> AsyncIterator[None]:
        runner = web.AppRunner(make_metrics_app(gw), access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, config.listen.host, config.listen.metrics_port).start()
            yield
        finally:
            await runner.cleanup()

    app.cleanup_ctx.extend([metrics_server, store, key_watcher, pools])
    r = app.router
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_get("/v1/models", list_models)
    for path, handler in (
        ("/v1/chat/completions", chat),
        ("/v1/completions", completions),
        ("/generate", generate),
    ):
        r.add_post(path, handler, expect_handler=expect_after_auth)
    return app
