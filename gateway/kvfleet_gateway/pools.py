"""The pools a gateway fronts: each one InferenceService's engines, with its own routing policy,
prefix index, LoRA adapters and overload queue; one gateway, one key, one budget per tenant
across them all. A request goes to the pool that serves its `model` (a served name, an alias,
an adapter, or `<base>:<adapter>`).

Pools read from `poolsFile` are re-read when the file changes: a new pool starts (discovery,
health checks, event streams) while the others serve on; a removed one stops after its
requests in flight end; a changed one is replaced. Nothing restarts the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvfleet_gateway.backends import BackendPool, engine_auth_headers
from kvfleet_gateway.config import ConfigError, GatewayConfig, ModelConfig, PoolConfig, Price
from kvfleet_gateway.config.pools import check_unique, load_pools
from kvfleet_gateway.disaggregation import PrefillSide, prefill_pool_running, prefill_side
from kvfleet_gateway.discovery import PodDiscovery, kube_access
from kvfleet_gateway.fair_gate import FairGate
from kvfleet_gateway.kv_events.prompts import PromptTokenizer
from kvfleet_gateway.kv_events.streams import KvEventStreams
from kvfleet_gateway.lora import AdapterManager, Target, resolve
from kvfleet_gateway.metrics import GatewayMetrics
from kvfleet_gateway.model_config import read_model_config
from kvfleet_gateway.proxy import Proxy
from kvfleet_gateway.routing import EventIndex, Policy, make_policy, priors_for
from kvfleet_gateway.routing.least_load import LeastLoad
from kvfleet_gateway.tasks import every

log = logging.getLogger("kvfleet.gateway")


@dataclass
class ModelPool:
    """One pool of engines and everything that routes to it."""

    config: PoolConfig
    backends: BackendPool
    policy: Policy
    fair: FairGate
    lora: AdapterManager
    prefill: PrefillSide | None = None
    events: EventIndex | None = None
    """Exact prefix state from the engines' KV events (prefixIndex.source: events)."""
    prompts: PromptTokenizer | None = None
    vocab_size: int | None = None
    """The model's vocabulary (from routing.tuning.modelConfig): token ids are bounded by it;
    None: not known, and requests with token ids are refused."""
    proxy: Proxy | None = None
    """Set while the pool runs (it needs the gateway's HTTP session)."""
    models: dict[str, ModelConfig] = field(init=False)
    aliases: dict[str, str] = field(init=False)
    """Alias → served name."""

    def __post_init__(self) -> None:
        self.models = {m.name: m for m in self.config.models}
        self.aliases = {a: m.name for m in self.config.models for a in m.aliases}

    @property
    def name(self) -> str:
        return self.config.name

    def busy(self) -> bool:
        """Requests in flight on its replicas, or held waiting for one."""
        held = self.proxy.held if self.proxy is not None else 0
        return bool(held) or any(b.inflight_requests for b in self.backends.backends.values())

    def served(self) -> dict[str, int | None]:
        """Served name → context length (the config's, else the engines'); a pool configured
        without models serves what its engines report."""
        learned = self.backends.served_models()
        if not self.models:
            return learned
        return {n: m.context_length or learned.get(n) for n, m in self.models.items()}

    def adapters(self, served: dict[str, int | None] | None = None) -> dict[str, str]:
        """Adapter → base model: configured, and reported by the engines (`served`: what
        `served()` returned, when the caller has it)."""
        served = self.served() if served is None else served
        return self.lora.known(list(self.backends.backends.values()), served)

    def price(self, base: str) -> Price | None:
        model = self.models.get(base)
        return model.price if model is not None else None

    def resolve(self, model: str, served: dict[str, int | None]) -> Target:
        """What `model` names here, given what the pool serves (an unknown name is left as
        it is: the caller's 404)."""
        model = self.aliases.get(model, model)
        if model in served:
            return Target(model)
        return resolve(model, served, self.adapters(served))


def build_pool(pc: PoolConfig, config: GatewayConfig, metrics: GatewayMetrics) -> ModelPool:
    """A pool's routing pieces from its config (a `ConfigError` names the bad field)."""
    index_config = pc.routing.prefix_index
    events = EventIndex() if index_config.source == "events" else None
    prompts = None
    if events is not None and index_config.tokenizer:
        try:
            prompts = PromptTokenizer.load(index_config.tokenizer)
        except ValueError as e:
            raise ConfigError("routing.prefixIndex.tokenizer", str(e)) from None
    t = pc.routing.tuning
    try:
        priors = priors_for(t.model_config, t.gpu, t.tensor_parallel, t.peak_efficiency)
    except ValueError as e:
        raise ConfigError("routing.tuning.modelConfig", str(e)) from None
    log.info("pool %s: routing priors: %s", pc.name, priors)
    vocab = read_model_config(Path(t.model_config)).vocab_size if t.model_config else None
    policy = make_policy(pc.routing.policy, t, events, priors)
    # Disaggregated: the policy picks prefill engines (where prefixes are cached); decode
    # engines hold no prefix cache, so the least loaded takes the decode half.
    prefill = prefill_side(pc, config.health_interval, policy)
    if prefill is not None:
        policy = make_policy(LeastLoad.name)
    backends = BackendPool(pc.backends.static, config.health_interval, pc.routing.scrape_interval)
    backends.track_adapters = bool(pc.lora.adapters)
    backends.removed_hook = policy.on_removed
    lora = AdapterManager(pc.lora, pc.models[0].name if pc.models else None)
    return ModelPool(
        config=pc,
        backends=backends,
        policy=policy,
        fair=FairGate(pc.fairness, backends, metrics),
        lora=lora,
        prefill=prefill,
        events=events,
        prompts=prompts,
        vocab_size=vocab,
    )


UPSTREAM_KEEPALIVE_S = 4.0
"""How long an idle connection to an engine is kept for reuse."""


def engine_session(config: GatewayConfig, headers: dict[str, str]) -> aiohttp.ClientSession:
    """A pool's connections to its engines, with their key in every request."""
    # Idle engine connections are dropped before the engine's own keep-alive ends
    # (uvicorn, SGLang's server: 5 s), so a request never goes out on a connection the
    # engine is closing — once sent, a request is not retried elsewhere.
    connector = aiohttp.TCPConnector(
        limit=0, ttl_dns_cache=300, keepalive_timeout=UPSTREAM_KEEPALIVE_S
    )
    timeout = aiohttp.ClientTimeout(total=None, connect=config.timeouts.connect)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers)


@contextlib.asynccontextmanager
async def pool_running(
    pool: ModelPool, config: GatewayConfig, metrics: GatewayMetrics
) -> AsyncIterator[None]:
    """Health checks, signals, pod discovery and event streams of one pool, while it runs.
    Each pool has its own engines' key (read here: a pool whose key is not there yet fails
    to start, and is started again at the next reload)."""
    pc = pool.config
    engine_headers = engine_auth_headers(pc.backends.engine_api_key_file)
    async with contextlib.AsyncExitStack() as stack:
        session = await stack.enter_async_context(engine_session(config, engine_headers))
        await stack.enter_async_context(_pool_parts(pool, config, metrics, session, engine_headers))
        yield


@contextlib.asynccontextmanager
async def _pool_parts(
    pool: ModelPool,
    config: GatewayConfig,
    metrics: GatewayMetrics,
    session: aiohttp.ClientSession,
    engine_headers: dict[str, str],
) -> AsyncIterator[None]:
    pc = pool.config
    pool.proxy = Proxy(session, pool.backends, pool.policy, config.timeouts, metrics,
                       config.hold, pool.prefill,
                       pool.fair.saturation if pc.fairness.enabled else None,
                       pool.lora)  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(pool.backends.running(session))
        await stack.enter_async_context(prefill_pool_running(pool.prefill, pc, session))
        await stack.enter_async_context(pool.fair.running_pump())
        kube = pc.backends.kubernetes
        if kube is not None:
            static = set(pc.backends.static)
            members = pool.backends.set_members
            finder = PodDiscovery(kube_access(kube.kubeconfig), kube,
                                  lambda urls: members(static | urls))  # fmt: skip
            await stack.enter_async_context(finder.running())
        if pool.events is not None:
            # Prefixes are cached where prompts are computed: the prefill pool, when there is one.
            side = pool.prefill.pool if pool.prefill else pool.backends
            streams = KvEventStreams(
                pool.events,
                metrics,
                lambda: [b.url for b in side.backends.values() if b.healthy and not b.draining],
            )
            events_session = await stack.enter_async_context(
                aiohttp.ClientSession(headers=engine_headers)
            )
            await stack.enter_async_context(streams.running(events_session))
        yield


class PoolSet:
    """The pools of one gateway by name, and which serves which model name."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.config, self.metrics = config, metrics
        self._digest: bytes | None = None
        single = config.single_pool()
        initial = (single,) if single is not None else config.pools
        if config.pools_file:  # a broken file at start stops the gateway: it would serve nothing
            initial = self._with_file(load_pools(Path(config.pools_file)))
            self._digest = self._file_digest()
        for pc in initial:  # a pool whose engines' key cannot be read stops the start
            engine_auth_headers(pc.backends.engine_api_key_file)
        self.pools: dict[str, ModelPool] = {pc.name: build_pool(pc, config, metrics)
                                            for pc in initial}  # fmt: skip
        self._stacks: dict[int, contextlib.AsyncExitStack] = {}
        """Each running pool's (by its id): what stops it."""
        self._index: dict[str, str] = {}
        self.reloads = 0
        self._reindex()

    def _reindex(self) -> None:
        self._index = {}
        for p in self.pools.values():
            for n in p.config.names() + [a.name for a in p.config.lora.adapters]:
                self._index[n] = p.name

    def only(self) -> ModelPool | None:
        """The pool of a gateway with one pool (a request without `model` goes there)."""
        return next(iter(self.pools.values())) if len(self.pools) == 1 else None

    def find(self, model: str) -> tuple[ModelPool, Target, int | None] | None:
        """The pool serving `model`, what it names there and its base model's context
        length; None: no pool serves it."""
        name = self._index.get(model) or self._index.get(model.rpartition(":")[0])
        pool = self.pools.get(name) if name else None
        if pool is None:  # learned names: engines' models and adapters, or one pool's
            learned = [p for p in self.pools.values()
                       if model in p.served() or model in p.adapters()]  # fmt: skip
            if len(learned) > 1:  # claimed by several services' engines: none is sure
                return None
            pool = learned[0] if learned else self.only()
        if pool is None:
            return None
        served = pool.served()  # once per request: it walks the pool's replicas
        target = pool.resolve(model, served)
        if target.base not in served:
            return None
        return pool, target, served[target.base]

    def served(self) -> list[tuple[ModelPool, str, int | None]]:
        return [(p, n, ctx) for p in self.pools.values() for n, ctx in p.served().items()]

    # ---- running ---------------------------------------------------------------------

    async def _start(self, pool: ModelPool) -> None:
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(pool_running(pool, self.config, self.metrics))
        self._stacks[id(pool)] = stack

    async def _stop(self, pool: ModelPool) -> None:
        """Stop a pool no longer in the index once its requests in flight end, and those it
        holds for a replica (it keeps discovering them meanwhile) — up to the drain timeout;
        polled, as requests end in many places: the proxy, its retries, the client leaving."""
        for _ in range(int(float(self.config.timeouts.drain) / 0.2)):
            if not pool.busy():
                break
            await asyncio.sleep(0.2)
        if pool.proxy is not None:
            pool.proxy.retired = True  # what it still holds is refused, not left waiting
        stack = self._stacks.pop(id(pool), None)
        if stack is not None:
            await stack.aclose()
        log.info("pool %s stopped", pool.name)

    async def _warm(self, new: ModelPool, old: ModelPool | None) -> None:
        """A replacement takes over once it has found a replica the old one had (or after a
        few health intervals): requests never meet a pool with none."""
        if old is None or not old.backends.routable():
            return
        for _ in range(int(4 * float(self.config.health_interval) / 0.1) + 20):
            if new.backends.routable():
                return
            await asyncio.sleep(0.1)

    async def apply(self, wanted: tuple[PoolConfig, ...]) -> bool:
        """Start new pools, replace changed ones (the new one serves before the old one
        stops), stop removed ones; False when a pool could not start (it is tried again at
        the next call, the old one serving meanwhile)."""
        by_name = {pc.name: pc for pc in wanted}
        removed = [p for n, p in self.pools.items() if n not in by_name]
        for pool in removed:
            del self.pools[pool.name]
        self._reindex()
        complete = True
        for pc in wanted:
            old = self.pools.get(pc.name)
            if old is not None and old.config == pc:
                continue
            try:
                pool = build_pool(pc, self.config, self.metrics)
                await self._start(pool)
            except (ConfigError, OSError) as exc:
                log.error("pool %s cannot start yet: %s", pc.name, exc)
                complete = False
                continue
            await self._warm(pool, old)
            self.pools[pc.name] = pool
            self._reindex()
            log.info("pool %s %s: %s", pc.name, "replaced" if old else "started",
                     ", ".join(pc.names()))  # fmt: skip
            if old is not None:
                removed.append(old)
        for pool in removed:
            await self._stop(pool)
        return complete

    def _with_file(self, from_file: tuple[PoolConfig, ...]) -> tuple[PoolConfig, ...]:
        both = self.config.pools + from_file
        check_unique(both, f"{self.config.pools_file}: pools")
        return both

    def _file_digest(self) -> bytes | None:
        try:
            return hashlib.sha256(Path(self.config.pools_file or "").read_bytes()).digest()
        except OSError:
            return None

    def _read_changed(self) -> tuple[PoolConfig, ...] | None:
        """The pools (the config's and the file's) when the file changed and is valid."""
        digest = self._file_digest()
        if digest is None or digest == self._digest:
            return None
        self._digest = digest
        try:
            return self._with_file(load_pools(Path(self.config.pools_file or "")))
        except ConfigError as exc:
            log.error("pools file changed but is invalid; keeping the pools: %s", exc)
            return None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        for pool in self.pools.values():
            await self._start(pool)

        async def reload() -> None:
            wanted = self._read_changed()
            if wanted is not None:
                if not await self.apply(wanted):
                    self._digest = None  # read it again next time: a pool is missing
                self.reloads += 1

        try:
            if self.config.pools_file:
                async with every(1.0, reload, "pools-file-watcher"):
                    yield
            else:
                yield
        finally:
            for stack in list(self._stacks.values()):
                await stack.aclose()
            self._stacks.clear()
