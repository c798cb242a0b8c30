"""LoRA adapters at the gateway: which model a request names, which replicas hold its adapter
(as their engines' /v1/models say), and loading it where none does.

A client names an adapter as `model: "<adapter>"` or `"<base>:<adapter>"`; the engine is sent
`"<base>:<adapter>"` (SGLang's form). Replicas that hold the adapter are preferred (the
routing policy balances load and prefix hits among them), and a replica that does not is
offered too when every holder has requests waiting and it has none (`affinity`: a popular
adapter spreads instead of queueing where it was loaded first, but not at saturation, where
that only crowds batches); when none holds it, the policy's
choice among all replicas loads it first — at most `maxConcurrentLoads` at once per replica,
unloading the least recently used adapter not in use when the replica holds
`maxAdaptersPerReplica`. What a replica holds is re-read from its engine at every health
probe, so an adapter loaded or unloaded behind the gateway's back is known within a probe.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvfleet_gateway.backends import Backend
from kvfleet_gateway.config.lora import AdapterSource, Lora
from kvfleet_gateway.errors import GatewayError
from kvfleet_gateway.routing.base import Candidate

log = logging.getLogger("kvfleet.gateway.lora")
LOAD_TIMEOUT_S = 120.0
"""Longest an adapter load may take (weights read from disk or downloaded)."""


@dataclass(frozen=True)
class Target:
    """What a request's `model` names: a base model, and maybe one of its adapters."""

    base: str
    adapter: str | None = None

    @property
    def engine_model(self) -> str:
        return self.base if self.adapter is None else f"{self.base}:{self.adapter}"


def resolve(model: str, served: dict[str, int | None], adapters: dict[str, str]) -> Target:
    """`model` as a base model, `<adapter>`, or `<base>:<adapter>`; `adapters` maps each known
    adapter to its base. Unknown names are left as they are (the caller's 404)."""
    if model in served:
        return Target(model)
    if model in adapters:
        return Target(adapters[model], model)
    base, sep, name = model.rpartition(":")
    if sep and base in served and adapters.get(name) == base:
        return Target(base, name)
    return Target(model)


def affinity(held: list[bool], waiting: list[int | None]) -> list[int]:
    """Which replicas (indexes) to offer the routing policy for a request with an adapter:
    those that hold it; and, when every holder has requests waiting in its engine's queue,
    those that do not hold it but wait for nothing — a load is worth its cost only where it
    lets the request start at once (at saturation every replica waits, and spreading an
    adapter would only crowd batches with more adapters). All of them when none holds it.
    `waiting`: each engine's scraped queue (None: not known, never spilled to). Pure: the
    gateway and the fleet simulator both decide with it."""
    holders = [i for i, h in enumerate(held) if h]
    if not holders:
        return list(range(len(held)))
    if any(waiting[i] is None or waiting[i] == 0 for i in holders):
        return holders
    idle = [i for i, h in enumerate(held) if not h and waiting[i] == 0]
    return sorted(holders + idle)


def eviction(held: list[str], busy: set[str], last_used: dict[str, float], bound: int
             ) -> str | None:  # fmt: skip
    """The adapter to unload before a replica holding `held` loads another: the least
    recently used one not `busy`, once it holds `bound`; None: room enough, or every adapter
    in use. Pure: the gateway and the fleet simulator both decide with it."""
    idle = [n for n in held if n not in busy]
    if len(held) < bound or not idle:
        return None
    return min(idle, key=lambda n: last_used.get(n, 0.0))


def queue_of(c: Candidate) -> int | None:
    """A replica's waiting requests as last scraped (None: no fresh scrape)."""
    return None if c.engine is None else c.engine.queue_reqs


@dataclass
class AdapterManager:
    config: Lora
    default_base: str | None = None
    in_use: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(backend, adapter) → requests running with it there (never unloaded while running)."""
    last_used: dict[tuple[str, str], float] = field(default_factory=dict)
    loaded_at: dict[tuple[str, str], float] = field(default_factory=dict)
    """(backend, adapter) → when this gateway loaded it there (`min_residency`)."""
    tenant_loads: dict[str, deque[float]] = field(default_factory=dict)
    """Tenant → when its requests caused loads, within the last minute."""
    _locks: dict[str, asyncio.Semaphore] = field(default_factory=dict)
    _sources: dict[str, AdapterSource] = field(init=False)

    def __post_init__(self) -> None:
        self._sources = {a.name: a for a in self.config.adapters}

    def sources(self) -> dict[str, AdapterSource]:
        """Adapter name → where it loads from (what the config lists)."""
        return self._sources

    def known(self, backends: list[Backend], served: dict[str, int | None]) -> dict[str, str]:
        """Adapter → base model: the configured ones, and those the engines report."""
        only = next(iter(served)) if len(served) == 1 else self.default_base
        out = {a.name: a.base or only or "" for a in self.config.adapters}
        for b in backends:
            for name, parent in b.adapters.items():
                out.setdefault(name, parent)
        return {k: v for k, v in out.items() if v}

    def offered(self, candidates: list[Backend], adapter: str) -> list[Backend]:
        """The replicas the routing policy may choose for `adapter` (see `affinity`)."""
        now = time.monotonic()
        held = [adapter in b.adapters for b in candidates]
        waiting = [b.queue_now(now) for b in candidates]
        return [candidates[i] for i in affinity(held, waiting)]

    def started(self, backend: Backend, adapter: str) -> None:
        self.in_use[(backend.url, adapter)] += 1
        self.last_used[(backend.url, adapter)] = time.monotonic()

    def ended(self, backend: Backend, adapter: str) -> None:
        key = (backend.url, adapter)
        self.in_use[key] -= 1
        if self.in_use[key] <= 0:
            del self.in_use[key]

    def _check_tenant_rate(self, tenant: str, now: float) -> None:
        """A 429 when `tenant`'s requests caused `tenantLoadsPerMinute` loads in the last
        minute: loads are replica time every tenant shares."""
        loads = self.tenant_loads.setdefault(tenant, deque())
        while loads and loads[0] <= now - 60.0:
            loads.popleft()
        limit = self.config.tenant_loads_per_minute
        if len(loads) >= limit:
            retry = {"Retry-After": str(max(1, math.ceil(loads[0] + 60.0 - now)))}
            raise GatewayError(429, f"this key caused {limit} adapter loads in the last minute"
                               " (lora.tenantLoadsPerMinute); use an adapter a replica holds,"
                               " or retry later", "requests", "adapter_loads_exceeded",
                               headers=retry)  # fmt: skip

    async def ensure(self, session: aiohttp.ClientSession, backend: Backend, adapter: str,
                     base: str, tenant: str = "") -> bool:  # fmt: skip
        """Make `backend` hold `adapter` (a 503 when it cannot be loaded there, a 429 when
        `tenant` caused too many loads); True when it was loaded for this request."""
        if adapter in backend.adapters:
            return False
        self._check_tenant_rate(tenant, time.monotonic())
        source = self.sources().get(adapter)
        if source is None:
            raise GatewayError(503, f"no replica holds the adapter '{adapter}' and the gateway"
                               " has no source to load it from", "server_error",
                               "adapter_unavailable")  # fmt: skip
        lock = self._locks.setdefault(
            backend.url, asyncio.Semaphore(self.config.max_concurrent_loads)
        )
        async with lock:
            if adapter in backend.adapters:  # another request loaded it meanwhile
                return False
            await self._make_room(session, backend)
            body = {"lora_name": adapter, "lora_path": source.path}
            answer = await self._post(session, backend, "/load_lora_adapter", body)
            if answer is None or not answer.get("success"):
                why = (answer or {}).get("error_message") or "no answer"
                raise GatewayError(503, f"the adapter '{adapter}' could not be loaded: {why}",
                                   "server_error", "adapter_unavailable")  # fmt: skip
            backend.adapters = {n: base for n in (answer.get("loaded_adapters") or {adapter: ""})}
            backend.adapters_changed += 1
            now = time.monotonic()
            self.loaded_at[(backend.url, adapter)] = now
            self.tenant_loads.setdefault(tenant, deque()).append(now)
            log.info("loaded adapter %s on %s", adapter, backend.url)
            return True

    async def _make_room(self, session: aiohttp.ClientSession, backend: Backend) -> None:
        """Unload the least recently used adapter not in use when the replica is full."""
        held, url, now = list(backend.adapters), backend.url, time.monotonic()
        busy = {n for n in held if self.in_use.get((url, n))}
        used = {n: self.last_used.get((url, n), 0.0) for n in held}
        bound, residency = self.config.max_adapters_per_replica, float(self.config.min_residency)
        loaded = {n: self.loaded_at[(url, n)] for n in held if (url, n) in self.loaded_at}
        young = {n: t + residency - now for n, t in loaded.items() if now - t < residency}
        victim = eviction(held, busy | young.keys(), used, bound)
        if victim is None and young and eviction(held, busy, used, bound) is not None:
            # Only adapters loaded moments ago could make room: churn waits for them.
            retry = {"Retry-After": str(max(1, math.ceil(min(young.values()))))}
            raise GatewayError(503, "every adapter this replica could unload was loaded within"
                               f" lora.minResidency ({residency:g}s); retry shortly",
                               "server_error", "adapter_unavailable", headers=retry)  # fmt: skip
        if victim is None:
            return
        answer = await self._post(session, backend, "/unload_lora_adapter", {"lora_name": victim})
        if answer is not None and answer.get("success"):
            backend.adapters.pop(victim, None)
            backend.adapters_changed += 1
            self.last_used.pop((backend.url, victim), None)
            self.loaded_at.pop((backend.url, victim), None)
            log.info("unloaded adapter %s on %s (least recently used)", victim, backend.url)

    @staticmethod
    async def _post(session: aiohttp.ClientSession, backend: Backend, path: str,
                    body: dict[str, str]) -> dict[str, Any] | None:  # fmt: skip
        try:
            timeout = aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S)
            async with session.post(f"{backend.url}{path}", json=body, timeout=timeout) as r:
                answer = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return answer if isinstance(answer, dict) else None
