"""The replicas the gateway may use: membership, health, engine signals, circuit breakers.

Every `interval_s` each backend is probed (`/health`; `/v1/models` once for its served names
and context length), and every `scrape_interval_s` its `/metrics` are read for the signals
routing uses. Only healthy, non-draining backends whose breaker allows it get requests. A
backend that leaves the set is drained: nothing new goes there, in-flight requests finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvfleet_gateway.breaker import Breaker
from kvfleet_gateway.config import ConfigError
from kvfleet_gateway.routing import Candidate, EngineSignals
from kvfleet_gateway.signals import parse_metrics
from kvfleet_gateway.tasks import every

log = logging.getLogger("kvfleet.gateway.backends")

STALE_AFTER_S = 5.0
"""Signals older than this are not used: routing falls back to the gateway's own counts."""
PROBE_FAILURES = 3
"""Failed health probes in a row that eject a replica (a refused connection ejects at once)."""


@dataclass(eq=False)
class Backend:
    url: str
    healthy: bool = False
    probe_failures: int = 0
    """Consecutive failed health probes."""
    probed: bool = False
    """Probed at least once: until then a new member is starting, not failing."""
    draining: bool = False
    inflight_requests: int = 0
    inflight_tokens: int = 0
    models: dict[str, int | None] = field(default_factory=dict)
    """Served model name → context length, from the backend's /v1/models."""
    adapters: dict[str, str] = field(default_factory=dict)
    """LoRA adapters the engine holds → their base model (its /v1/models entries with a
    parent)."""
    adapters_changed: int = 0
    """Counts the gateway's own loads and unloads here: a probe's reading of /v1/models taken
    before one of them is stale and is not applied."""
    finished_requests: int = 0
    """Requests this gateway sent here that have ended (a running count)."""
    finished_at_scrape: int = 0
    """`finished_requests` when the signals in hand were scraped."""
    signals: EngineSignals | None = None
    scraped_at: float = 0.0
    breaker: Breaker = field(default_factory=Breaker)

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining and self.breaker.allows()

    def queue_now(self, now: float) -> int | None:
        """The engine's waiting requests as last scraped, less the requests this gateway saw
        end there since (each lets a waiting one in): a scrape taken while a request waited
        says nothing about the next once it has finished. None: no fresh scrape."""
        c = self.candidate(now)
        if c.engine is None:
            return None
        return max(0, c.engine.queue_reqs - (self.finished_requests - self.finished_at_scrape))

    def candidate(self, now: float) -> Candidate:
        s = self.signals
        age = now - self.scraped_at
        fresh = None
        if s is not None and age <= STALE_AFTER_S:
            fresh = EngineSignals(
                s.queue_reqs,
                s.running_reqs,
                s.token_usage,
                s.max_total_tokens,
                s.cache_hit_rate,
                age,
            )
        return Candidate(self.url, self.inflight_requests, self.inflight_tokens, fresh)


class BackendPool:
    def __init__(
        self, urls: Iterable[str], interval_s: float = 2.0, scrape_interval_s: float = 1.0
    ) -> None:
        self.backends: dict[str, Backend] = {}
        self.interval_s = interval_s
        self.scrape_interval_s = scrape_interval_s
        self.removed_hook: Callable[[str], None] | None = None
        """Told about every backend that leaves for good (the routing policy forgets it)."""
        self.track_adapters = False
        """Re-read /v1/models at every probe (LoRA: what each engine holds changes)."""
        self.set_members(urls)

    def set_members(self, urls: Iterable[str]) -> None:
        """Add new backends; drain those no longer wanted (removed once idle)."""
        wanted = {u.rstrip("/") for u in urls}
        for url in wanted - self.backends.keys():
            self.backends[url] = Backend(url)
        for url, b in self.backends.items():
            b.draining = url not in wanted
        self.forget_drained()

    def forget_drained(self) -> list[str]:
        gone = [u for u, b in self.backends.items() if b.draining and not b.inflight_requests]
        for url in gone:
            del self.backends[url]
            if self.removed_hook is not None:
                self.removed_hook(url)
        return gone

    def routable(self, model: str | None = None) -> list[Backend]:
        return [
            b
            for b in self.backends.values()
            if b.routable and (model is None or not b.models or model in b.models)
        ]

    def _staying(self, probed: bool, model: str | None = None) -> bool:
        """Whether a replica that is not draining, probed or not yet, may serve `model`
        (None: any model)."""
        return any(
            b.probed == probed and not b.draining
            and (model is None or not b.models or model in b.models)
            for b in self.backends.values()
        )  # fmt: skip

    def has_members(self, model: str) -> bool:
        """Whether any probed replica that stays (healthy or not) may serve `model`: none
        means the fleet is scaled to zero, leaving, or new, which is worth waiting for;
        probed members that fail are an outage, which is not."""
        return self._staying(True, model)

    def has_new_members(self, model: str) -> bool:
        """Whether a replica not yet probed may serve `model` (discovered during a rollout or
        a scale-up): a request whose replicas failed is worth holding for it."""
        return self._staying(False, model)

    def worth_holding(self, model: str) -> bool:
        """No replica of `model` can take the request now: hold it when no probed replica
        stays (scaled to zero, or all leaving: a rollout), or when a new one is about to be
        checked. Replicas that stay and fail are an outage: no hold."""
        return not self.has_members(model) or self.has_new_members(model)

    def starting(self) -> bool:
        """No member that stays has been probed yet: the pool is scaled to zero, or every
        replica in it is new (just discovered, or a rollout replaced them all). Requests for
        it are held, not refused, so the gateway stays ready meanwhile."""
        return not self._staying(True)

    def served_models(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for b in self.backends.values():
            if b.healthy:
                for name, ctx in b.models.items():
                    out[name] = ctx if out.get(name) is None else out[name]
        return out

    async def probe(self, session: aiohttp.ClientSession, b: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=min(5.0, self.interval_s * 2))
        gone = False
        adapters_changed = b.adapters_changed
        try:
            async with session.get(f"{b.url}/health", timeout=timeout) as r:
                ok = r.status == 200
            if ok and (not b.models or self.track_adapters):
                async with session.get(f"{b.url}/v1/models", timeout=timeout) as r:
                    if r.status in (401, 403):  # /health needs no key; the API does
                        if not b.probed or b.healthy:
                            log.warning(
                                "backend %s refused the gateway's engine key (%d): set "
                                "backends.engineApiKeyFile to the engines' --api-key",
                                b.url, r.status,
                            )  # fmt: skip
                        raise ValueError("engine key refused")
                    data = await r.json()
                cards = data.get("data", [])
                b.models = {m["id"]: m.get("max_model_len") for m in cards if not m.get("parent")}
                if b.adapters_changed == adapters_changed:  # no load or unload meanwhile
                    b.adapters = {m["id"]: m["parent"] for m in cards if m.get("parent")}
        except aiohttp.ClientConnectorError:
            ok, gone = False, True  # nothing listens: the replica is gone, eject it now
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            ok = False
        b.probed = True
        # A slow or failed probe of a replica that is serving is not an outage: like a
        # Kubernetes probe's failureThreshold, it takes several in a row to eject it.
        b.probe_failures = 0 if ok else b.probe_failures + 1
        if b.healthy and not ok and not gone and b.probe_failures < PROBE_FAILURES:
            return
        if ok != b.healthy:
            log.info("backend %s is %s", b.url, "healthy" if ok else "unhealthy")
        b.healthy = ok

    async def scrape(self, session: aiohttp.ClientSession, b: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=max(0.5, self.scrape_interval_s))
        finished = b.finished_requests
        try:
            async with session.get(f"{b.url}/metrics", timeout=timeout) as r:
                text = await r.text() if r.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError):
            return  # stale signals age out; health checks decide about the backend itself
        signals = parse_metrics(text)
        if signals is not None:
            b.signals, b.scraped_at, b.finished_at_scrape = signals, time.monotonic(), finished

    async def probe_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.probe(session, b) for b in list(self.backends.values())))
        self.forget_drained()

    async def scrape_all(self, session: aiohttp.ClientSession) -> None:
        live = [b for b in self.backends.values() if b.healthy]
        await asyncio.gather(*(self.scrape(session, b) for b in live))

    @contextlib.asynccontextmanager
    async def running(self, session: aiohttp.ClientSession) -> AsyncIterator[BackendPool]:
        await self.probe_all(session)
        await self.scrape_all(session)
        async with (
            every(self.interval_s, lambda: self.probe_all(session), "backend-health"),
            every(self.scrape_interval_s, lambda: self.scrape_all(session), "backend-metrics"),
        ):
            yield self


def read_secret_file(path: str | None, field: str) -> str | None:
    """One secret from a file (a mounted Secret's key may end in a newline); `field` names
    the config setting in errors. None when no file is configured."""
    if path is None:
        return None
    try:
        value = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(field, f"cannot read {path}: {e}") from None
    if not value or any(c.isspace() or ord(c) < 0x21 for c in value):
        raise ConfigError(field, f"{path} must hold one value: no spaces or controls")
    return value


def engine_auth_headers(key_file: str | None) -> dict[str, str]:
    """What every request to an engine carries: its API key, when the engines have one
    (SGLang checks it on all but /health*, /ready* and /metrics*)."""
    key = read_secret_file(key_file, "backends.engineApiKeyFile")
    return {"Authorization": f"Bearer {key}"} if key else {}
