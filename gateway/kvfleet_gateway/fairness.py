"""Fair sharing under overload: who goes next when every replica of a model is busy.

Pure: no clock, no I/O. The gateway's `FairGate` (fair_gate.py) and the fleet simulator hold
their waiting requests in a `FairQueue` and ask `saturated` whether the pool can take one
more, so `kvfleet bench fairness` measures the code the gateway runs.

The order is the Virtual Token Counter's (Sheng et al., "Fairness in Serving Large Language
Models", OSDI'24): every tenant has a counter of the service it received — prompt tokens
times `prompt_weight` when a request is dispatched, output tokens times `output_weight`
when it ends, each divided by the tenant's weight — and the next request is the oldest of
the waiting tenant with the smallest counter. A tenant that had nothing waiting has its
counter lifted to the smallest counter among those waiting (or to the last dispatched
tenant's when none waits), so idleness banks no credit to spend in a burst later. Priority
classes come first: a `critical` request goes before any `standard` one, which goes before
any `sheddable` one; when the pool is saturated a sheddable request is refused rather than
queued (the caller answers 503 with Retry-After, nothing billed).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from kvfleet_gateway.routing import Candidate

Priority = Literal["critical", "standard", "sheddable"]
PRIORITIES: tuple[Priority, ...] = ("critical", "standard", "sheddable")
T = TypeVar("T")


@dataclass(frozen=True)
class Saturation:
    """When a model's pool can take no more requests from this gateway."""

    max_inflight_per_replica: int | None = None
    """Requests this gateway keeps in flight on one replica (its batch slots); None: no
    count bound, the engine's signals alone say."""
    queue_per_replica: float | None = None
    """An engine with at least this many requests waiting is saturated (fresh signals only);
    None: not judged."""
    kv_cache_usage: float | None = None
    """An engine whose KV cache is at least this full is saturated; None: not judged."""


def saturated(running: int, candidates: Sequence[Candidate], s: Saturation) -> bool:
    """Whether the pool can take no more: this gateway's `running` requests of the model fill
    every replica's slots, or every replica's fresh signals say it is full. No replica at all
    is not saturation (the hold for scale from zero waits for one)."""
    if not candidates:
        return False
    slots = s.max_inflight_per_replica
    if slots is not None and running >= slots * len(candidates):
        return True
    return all(_engine_full(c, s) for c in candidates)


def _engine_full(c: Candidate, s: Saturation) -> bool:
    e = c.engine
    if e is None:
        return False
    if s.queue_per_replica is not None and e.queue_reqs >= s.queue_per_replica:
        return True
    return s.kv_cache_usage is not None and e.token_usage >= s.kv_cache_usage


@dataclass(frozen=True)
class ServiceWeights:
    prompt_weight: float = 1.0
    """Counter units per prompt token dispatched."""
    output_weight: float = 2.0
    """Counter units per output token (VTC's default: an output token costs a decode step)."""


@dataclass
class _Entry(Generic[T]):
    item: T
    tenant: str
    seq: int
    """Arrival order: among tenants with equal counters, the longest waiting goes first."""


@dataclass
class FairQueue(Generic[T]):
    """Waiting requests of one model, in VTC order within strict priority classes."""

    max_waiting: int
    weights: ServiceWeights = field(default_factory=ServiceWeights)
    counters: dict[str, float] = field(default_factory=dict)
    """Tenant → service received, weighted (what fairness equalises)."""
    _waiting: dict[Priority, dict[str, deque[_Entry[T]]]] = field(
        default_factory=lambda: {p: {} for p in PRIORITIES}
    )
    _size: int = 0
    _seq: int = 0
    _last_dispatched: str | None = None

    def __len__(self) -> int:
        return self._size

    def waiting_by_tenant(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for band in self._waiting.values():
            for tenant, q in band.items():
                out[tenant] = out.get(tenant, 0) + len(q)
        return out

    def push(self, item: T, tenant: str, priority: Priority = "standard") -> bool:
        """Queue `item`; False when the queue is full (the caller refuses it)."""
        if self._size >= self.max_waiting:
            return False
        band = self._waiting[priority]
        if not any(tenant in b for b in self._waiting.values()):
            self._lift(tenant)
        band.setdefault(tenant, deque()).append(_Entry(item, tenant, self._seq))
        self._size += 1
        self._seq += 1
        return True

    def _lift(self, tenant: str) -> None:
        """A tenant starts waiting: no credit for the time it was idle."""
        waiting = {t for b in self._waiting.values() for t in b}
        floor = (
            min(self.counters.get(t, 0.0) for t in waiting)
            if waiting
            else self.counters.get(self._last_dispatched or "", 0.0)
        )
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def pop(self) -> tuple[T, str] | None:
        """The next request to dispatch and its tenant (None: nothing waits)."""
        for priority in PRIORITIES:
            band = self._waiting[priority]
            if not band:
                continue
            tenant = min(band, key=lambda t: (self.counters.get(t, 0.0), band[t][0].seq))
            q = band[tenant]
            entry = q.popleft()
            if not q:
                del band[tenant]
            self._size -= 1
            self._last_dispatched = tenant
            return entry.item, tenant
        return None

    def remove(self, item: T) -> bool:
        """Take a request out (its client left, its deadline passed); False: not queued."""
        for band in self._waiting.values():
            for tenant, q in band.items():
                for entry in q:
                    if entry.item is item:
                        q.remove(entry)
                        if not q:
                            del band[tenant]
                        self._size -= 1
                        return True
        return False

    def charge(self, tenant: str, weight: float, prompt_tokens: int = 0,
               output_tokens: int = 0) -> None:  # fmt: skip
        """Service a tenant received: a dispatched prompt, or the output of one that ended."""
        w = self.weights
        cost = prompt_tokens * w.prompt_weight + output_tokens * w.output_weight
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / max(weight, 1e-9)
