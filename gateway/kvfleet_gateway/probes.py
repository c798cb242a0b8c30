"""The probes and the scrapers' port: liveness, readiness (the clients' port says only ready
or not; the metrics port has the details), and /metrics."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfleet_gateway.limiter import budget_spec
from kvfleet_gateway.redis_store import RedisStore
from kvfleet_gateway.state import ANONYMOUS, GATEWAY, Gateway


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def _every_tenant_budgeted(gw: Gateway) -> bool:
    """Every tenant that can authenticate has a token budget: without the budget store this
    gateway can serve nobody (budgets fail closed)."""
    tenants = {t.name: t.limits for _, t in gw.keys.ring.entries} if gw.keys else {}
    if not tenants:
        tenants = {ANONYMOUS.name: ANONYMOUS.limits}
    return all(budget_spec(gw.config.limits_for(n, lim)) is not None for n, lim in tenants.items())


async def readiness(gw: Gateway) -> tuple[bool, dict[str, Any]]:
    """Ready when a replica can take requests, or when requests would be held: a pool none
    of whose replicas has been probed yet (scaled to zero: the gateway must stay reachable to
    wake the autoscaler; or every replica new: a gateway that just discovered them must not
    turn unready until its first health check of them, or the Service drops it and a Ready
    InferenceService has no gateway). Replicas that were probed and all fail are an outage:
    not ready. So is a budget store that does not answer when every tenant is budgeted: each
    request would get 503 (a tenant without a budget keeps the gateway ready, serving it on
    local rate limits)."""
    pools = list(gw.pools.pools.values())
    routable = [b for p in pools for b in p.backends.routable()]
    hold = gw.config.hold.max_requests > 0
    detail: dict[str, Any] = {
        "ready": len(routable),
        "scaledToZero": hold and any(not p.backends.backends for p in pools),
    }
    ok = bool(routable) or (hold and any(p.backends.starting() for p in pools))
    prefills = [p.prefill.pool for p in pools if p.prefill is not None]
    if prefills:  # disaggregated: a request needs a whole pair
        detail["readyPrefill"] = sum(len(pool.routable()) for pool in prefills)
        starting = hold and any(pool.starting() for pool in prefills)
        ok = ok and (bool(detail["readyPrefill"]) or starting)
    if len(pools) > 1:  # a shared gateway: each pool's own count
        detail["pools"] = {p.name: len(p.backends.routable()) for p in pools}
    if isinstance(gw.store, RedisStore) and _every_tenant_budgeted(gw):
        store_ok = await gw.store.reachable()
        detail["limitsStore"] = "ok" if store_ok else "unreachable"
        ok = ok and store_ok
    return ok, detail


async def readyz(request: web.Request) -> web.Response:
    """The probe on the clients' port says ready or not, and nothing an unauthenticated
    caller could count (replicas, the budget store): those are on the metrics port."""
    ok, _ = await readiness(request.app[GATEWAY])
    return web.json_response({"ready": ok}, status=200 if ok else 503)


async def readyz_detail(request: web.Request) -> web.Response:
    ok, detail = await readiness(request.app[GATEWAY])
    return web.json_response(detail, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if isinstance(gw.store, RedisStore):
        gw.metrics.settlements_pending.set(len(gw.store.pending))
    gw.metrics.adapters.clear()  # what each engine holds now, as its /v1/models said
    for b in (b for p in gw.pools.pools.values() for b in p.backends.backends.values()):
        for adapter in b.adapters:
            gw.metrics.adapters.labels(b.url, adapter).set(1)
    return web.Response(
        body=generate_latest(gw.metrics.registry),
        headers={"Content-Type": CONTENT_TYPE_LATEST},
    )


def make_metrics_app(gw: Gateway) -> web.Application:
    """The scrapers' port: /metrics (and /healthz, for a probe that wants it)."""
    app = web.Application()
    app[GATEWAY] = gw
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz_detail)
    return app
