"""The set of engine replicas the gateway may use, their health, and what they serve.

Each backend is probed (`/health`, then `/v1/models` for served names and context length)
every `interval_s`; only healthy, non-draining backends receive new requests. A backend that
leaves the set is drained: it gets nothing new, and its in-flight requests finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import aiohttp

from kvfleet_gateway.tasks import every

log = logging.getLogger("kvfleet.gateway.backends")


@dataclass(eq=False)
class Backend:
    url: str
    healthy: bool = False
    draining: bool = False
    inflight_requests: int = 0
    inflight_tokens: int = 0
    models: dict[str, int | None] = field(default_factory=dict)
    """Served model name → context length, from the backend's /v1/models."""
    failures: int = 0

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining


class BackendPool:
    def __init__(self, urls: Iterable[str], interval_s: float = 2.0) -> None:
        self.backends: dict[str, Backend] = {}
        self.interval_s = interval_s
        self.set_members(urls)

    def set_members(self, urls: Iterable[str]) -> None:
        wanted = {u.rstrip("/") for u in urls}
        for url in wanted - self.backends.keys():
            self.backends[url] = Backend(url)
        for url, b in self.backends.items():
            b.draining = url not in wanted
        for url in [u for u, b in self.backends.items() if b.draining and not b.inflight_requests]:
            del self.backends[url]

    def routable(self, model: str | None = None) -> list[Backend]:
        return [
            b
            for b in self.backends.values()
            if b.routable and (model is None or not b.models or model in b.models)
        ]

    def served_models(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for b in self.backends.values():
            if b.healthy:
                for name, ctx in b.models.items():
                    out[name] = ctx if out.get(name) is None else out[name]
        return out

    async def probe(self, session: aiohttp.ClientSession, b: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=min(5.0, self.interval_s * 2))
        try:
            async with session.get(f"{b.url}/health", timeout=timeout) as r:
                ok = r.status == 200
            if ok and not b.models:
                async with session.get(f"{b.url}/v1/models", timeout=timeout) as r:
                    data = await r.json()
                b.models = {m["id"]: m.get("max_model_len") for m in data.get("data", [])}
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            ok = False
        if ok != b.healthy:
            log.info("backend %s is %s", b.url, "healthy" if ok else "unhealthy")
        b.healthy = ok
        b.failures = 0 if ok else b.failures + 1

    async def probe_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.probe(session, b) for b in list(self.backends.values())))
        self.set_members(u for u, b in self.backends.items() if not b.draining)

    @contextlib.asynccontextmanager
    async def running(self, session: aiohttp.ClientSession) -> AsyncIterator[BackendPool]:
        await self.probe_all(session)
        async with every(self.interval_s, lambda: self.probe_all(session), "backend-health"):
            yield self
