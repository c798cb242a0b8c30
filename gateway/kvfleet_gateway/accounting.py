"""What happens to an admitted request, whatever ends it: one structure, not a `try` per path.

`Admitted` is entered right after the store granted a lease. While the block runs it renews
the lease; when the block exits — a return, a `GatewayError`, a bug, the client leaving
(cancellation) — it settles the reservation to the billed usage exactly once (shielded from
cancellation), releases the lease, and records metrics and one access-log line. Code inside
the block cannot forget to release anything, because it never has to.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from types import TracebackType

from kvfleet_gateway.config import GatewayConfig
from kvfleet_gateway.errors import GatewayError
from kvfleet_gateway.exchange import Exchange
from kvfleet_gateway.limiter import Lease, LimitStore, cost_units
from kvfleet_gateway.metrics import GatewayMetrics

log = logging.getLogger("kvfleet.gateway")
access_log = logging.getLogger("kvfleet.gateway.access")


@dataclass
class Admitted:
    config: GatewayConfig
    store: LimitStore
    metrics: GatewayMetrics
    ex: Exchange
    lease: Lease
    _heartbeat: asyncio.Task[None] | None = field(default=None, init=False)

    async def __aenter__(self) -> Exchange:
        self.metrics.inflight.labels(self.ex.tenant, self.ex.req.model).inc()
        self._heartbeat = asyncio.create_task(self._renew(), name="lease-heartbeat")
        return self.ex

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._heartbeat is not None
        self._heartbeat.cancel()
        ex = self.ex
        if isinstance(exc, asyncio.CancelledError):
            # The handler is cancelled when its client goes away (or the gateway stops):
            # a client disconnect, whatever status the stream had started with.
            ex.client_gone, ex.status = True, 499
        elif isinstance(exc, GatewayError):
            ex.status = exc.status
        elif exc is not None:
            ex.status = 500
        # Settle exactly once, even if this handler is being cancelled right now.
        await asyncio.shield(self._finish())

    async def _renew(self) -> None:
        ttl = self.config.limits.lease_ttl
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                await self.store.heartbeat(self.lease, time.time(), ttl)
            except Exception:  # a missed heartbeat only shortens the lease's life
                log.warning("lease heartbeat failed for tenant %s", self.ex.tenant)

    def _report_budget(self) -> None:
        """The budget gauges after settling: what `kvfleet usage` reads is the store's state
        once this request's reservation became its real usage, not the state at admission
        (as the settlement itself returned it: no further round trip)."""
        state = self.store.budget_seen(self.lease.tenant)
        if state is not None:
            self.metrics.set_budget(self.lease.tenant, state)

    async def _finish(self) -> None:
        ex, m = self.ex, self.metrics
        usage = ex.billed_usage()
        reported = ex.usage
        if reported is not None and (usage.prompt_tokens, usage.completion_tokens) != (
            reported.prompt_tokens,
            reported.completion_tokens,
        ):
            m.usage_clamped.labels(ex.tenant).inc()
            log.warning(
                "engine %s reported usage outside the admission bound for tenant %s; billed"
                " the clamped value",
                ex.backend.url if ex.backend else "?",
                ex.tenant,
            )
        units = None
        if self.lease.budget_unit == "cost":
            # An adapter load is billed as that many prompt tokens at the model's price.
            cost = ex.price.cost(usage.prompt_tokens + ex.load_charge, usage.cached_tokens,
                                 usage.completion_tokens) if ex.price else 0.0  # fmt: skip
            units = min(cost_units(cost), self.lease.budget_reserved or 0)
        try:
            billed = min(usage.total + ex.load_charge, self.lease.reserved_tokens)
            await self.store.settle(self.lease, billed, time.time(), units)
            self._report_budget()
        except Exception:  # never let accounting failures escape into the response path
            log.exception("settlement failed for tenant %s", ex.tenant)
        labels = (ex.tenant, ex.req.model)
        m.inflight.labels(*labels).dec()
        m.requests.labels(*labels, str(ex.status or 500)).inc()
        end = time.monotonic()
        m.e2e.labels(*labels).observe(end - ex.started)
        ttft = None if ex.first_token_at is None else ex.first_token_at - ex.started
        if ttft is not None:
            m.ttft.labels(*labels).observe(ttft)
        gpu_s = m.record_usage(ex.tenant, ex.req.model, usage, ex.gpu_cost or self.config.cost,
                               ex.price)  # fmt: skip
        if not self.config.access_log:
            return
        access_log.info(
            json.dumps(
                {
                    "ts": round(time.time(), 3),
                    "tenant": ex.tenant,
                    "model": ex.req.model,
                    "kind": ex.req.kind,
                    "stream": ex.req.stream,
                    "backend": ex.backend.url if ex.backend else None,
                    "status": ex.status,
                    "prompt_tokens": usage.prompt_tokens,
                    "completion_tokens": usage.completion_tokens,
                    "cached_tokens": usage.cached_tokens,
                    "reserved_tokens": self.lease.reserved_tokens,
                    "usage_reported": ex.usage is not None,
                    "ttft_s": None if ttft is None else round(ttft, 4),
                    "e2e_s": round(end - ex.started, 4),
                    "gpu_seconds": round(gpu_s, 5),
                    "client_gone": ex.client_gone,
                }
            )
        )
