"""The gateway's overload queue: requests of a saturated model wait here, and go out in the
fair order of `fairness.FairQueue` as the pool frees room.

A request passes straight through when nothing of its model waits and the pool is not
saturated (no cost when there is no overload). Otherwise it waits — bounded in number and
time — unless it is sheddable, which is refused at once. Room is looked for again whenever a
request of the model ends and every `PUMP_INTERVAL_S` (the engines' scraped signals change,
replicas come and go). A request that waited is answered 503 `overloaded` with Retry-After
when its deadline passes; nothing was billed (no engine took it). No replica at all is not
overload: the hold (scale from zero) deals with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvfleet_gateway.backends import BackendPool
from kvfleet_gateway.config import Fairness, Limits
from kvfleet_gateway.errors import GatewayError
from kvfleet_gateway.exchange import Exchange
from kvfleet_gateway.fairness import FairQueue, Saturation, goes_now
from kvfleet_gateway.metrics import GatewayMetrics
from kvfleet_gateway.routing import Candidate
from kvfleet_gateway.tasks import every

PUMP_INTERVAL_S = 0.05
"""How often waiting requests look for room besides when a request ends."""


@dataclass
class FairGate:
    config: Fairness
    pool: BackendPool
    metrics: GatewayMetrics
    queues: dict[str, FairQueue[asyncio.Future[bool]]] = field(default_factory=dict)
    running: Counter[str] = field(default_factory=Counter)
    """Requests of each model this gateway let through that have not ended."""
    saturation: Saturation = field(init=False)
    """When a replica is full (built once from the config; the proxy shares it)."""

    def __post_init__(self) -> None:
        self.saturation = self.config.saturation()

    def _queue(self, model: str) -> FairQueue[asyncio.Future[bool]]:
        q = self.queues.get(model)
        if q is None:
            q = self.queues[model] = FairQueue(self.config.max_waiting,
                                               self.config.service_weights())  # fmt: skip
        return q

    def _candidates(self, model: str) -> list[Candidate]:
        now = time.monotonic()
        return [b.candidate(now) for b in self.pool.routable(model)]

    def _refuse(self, ex: Exchange, reason: str, message: str) -> GatewayError:
        self.metrics.shed.labels(ex.tenant, ex.req.model, reason).inc()
        retry = str(max(1, math.ceil(float(self.config.timeout) / 4)))
        return GatewayError(503, message, "server_error", "overloaded",
                            headers={"Retry-After": retry})  # fmt: skip

    @contextlib.asynccontextmanager
    async def slot(self, ex: Exchange, limits: Limits) -> AsyncIterator[None]:
        """Hold the request while the pool is saturated; let it through in fair order."""
        if not self.config.enabled:
            yield
            return
        model, tenant = ex.route.model, ex.tenant
        weight = limits.fair_share_weight or 1.0
        q = self._queue(model)
        if goes_now(q, tenant, self.running[model], self._candidates(model),
                    self.saturation):  # fmt: skip
            self.running[model] += 1
        else:
            await self._wait(ex, q, limits)
        q.charge(tenant, weight, prompt_tokens=ex.route.prompt_tokens)
        self._report(model, tenant, q)
        try:
            yield
        finally:
            self.running[model] -= 1
            q.charge(tenant, weight, output_tokens=ex.billed_usage().completion_tokens)
            self._report(model, tenant, q)
            self.pump(model)

    async def _wait(self, ex: Exchange, q: FairQueue[asyncio.Future[bool]],
                    limits: Limits) -> None:  # fmt: skip
        model = ex.route.model
        priority = limits.priority or "standard"
        if priority == "sheddable":
            raise self._refuse(ex, "sheddable", f"'{model}' is overloaded: sheddable requests"
                               " are refused until it has room; retry later")  # fmt: skip
        # The future's result: True, let through; False, displaced by a less served tenant.
        granted: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        for displaced in q.push(granted, ex.tenant, priority):
            if displaced is granted:
                raise self._refuse(ex, "queue_full", f"'{model}' is overloaded and"
                                   f" {len(q)} requests already wait; retry later")  # fmt: skip
            displaced.set_result(False)
        gauge = self.metrics.queued.labels(model)
        gauge.inc()
        try:
            async with asyncio.timeout(float(self.config.timeout)):
                if not await asyncio.shield(granted):
                    raise self._refuse(ex, "displaced", f"'{model}' is overloaded and its queue"
                                       " is full: your tenant holds the most of it; retry"
                                       " later")  # fmt: skip
        except TimeoutError:
            if not granted.done() or not granted.result():  # not let through (or displaced)
                q.remove(granted)
                raise self._refuse(
                    ex,
                    "timeout",
                    f"'{model}' stayed overloaded for {float(self.config.timeout):g}s; retry later",
                ) from None
        except asyncio.CancelledError:  # the client left
            if granted.done() and granted.result():
                self.running[model] -= 1  # let through, never used
                self.pump(model)
            else:
                q.remove(granted)
            raise
        finally:
            gauge.dec()

    def pump(self, model: str) -> None:
        """Let waiting requests of `model` through, in fair order, while the pool has room."""
        q = self.queues.get(model)
        if q is None:
            return
        candidates = self._candidates(model)
        while q.releasable(self.running[model], candidates, self.saturation):
            popped = q.pop()
            assert popped is not None
            self.running[model] += 1
            popped[0].set_result(True)

    def _report(self, model: str, tenant: str, q: FairQueue[asyncio.Future[bool]]) -> None:
        self.metrics.fair_service.labels(tenant, model).set(q.counters.get(tenant, 0.0))

    @contextlib.asynccontextmanager
    async def running_pump(self) -> AsyncIterator[None]:
        """The periodic look for room, while the block runs."""
        if not self.config.enabled:
            yield
            return

        async def pump_all() -> None:
            for model in list(self.queues):
                self.pump(model)

        async with every(PUMP_INTERVAL_S, pump_all, "fair-gate-pump"):
            yield
