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
queued (the caller answers 503 with Retry-After, nothing billed). With a slot reserve
(`Saturation.reserve_per_replica`), requests that waited and tenants at the top of the
service fill the pool only up to the reserve; a tenant under its share takes a reserved slot
at once instead of waiting for a request to end.
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
    reserve_per_replica: int = 0
    """Of `max_inflight_per_replica`, slots only a tenant under its fair share may take:
    with every slot held by a flood, a steady tenant would wait for the next request to end;
    with a reserve it starts at once."""


def room(running: int, candidates: Sequence[Candidate], s: Saturation,
         reserve: bool = True) -> int:  # fmt: skip
    """How many more requests of a model may go out now. With `max_inflight_per_replica`:
    the slots free on the replicas not full by their signals (each replica's own count, so
    one full replica does not lend its neighbour's room), bounded by what this gateway's
    `running` requests leave of all slots (requests let through and not placed yet count
    too); less the reserve unless `reserve` is False (a tenant under its share). Without
    it: one per replica whose fresh signals do not say it is full (a scrape's worth:
    signals lag what was just sent). No replica at all: 0 (the hold's business)."""
    open_ = [c for c in candidates if not _engine_full(c, s)]
    slots = s.max_inflight_per_replica
    if slots is None:
        return len(open_)
    usable = slots - (s.reserve_per_replica if reserve else 0)
    free = sum(max(0, usable - c.inflight_requests) for c in open_)
    return max(0, min(free, usable * len(candidates) - running))


def with_room(candidates: Sequence[Candidate], s: Saturation) -> list[Candidate]:
    """The replicas a request let through may go to: those under their slot bound (all of
    them when none is, or without a bound), so routing never queues it behind a full batch
    while another replica has a free slot."""
    slots = s.max_inflight_per_replica
    if slots is None:
        return list(candidates)
    open_ = [c for c in candidates if c.inflight_requests < slots and not _engine_full(c, s)]
    return open_ or list(candidates)


def saturated(running: int, candidates: Sequence[Candidate], s: Saturation) -> bool:
    """Whether the pool can take no more (even of a tenant under its share). No replica at
    all is not saturation (the hold for scale from zero waits for one)."""
    return bool(candidates) and room(running, candidates, s, reserve=False) == 0


def goes_now(q: FairQueue[T], tenant: str, running: int, candidates: Sequence[Candidate],
             s: Saturation) -> bool:  # fmt: skip
    """Whether a request of `tenant` arriving now goes out at once: nothing waits and the
    pool has room, or the tenant is under its share and a reserved slot is free. No replica
    at all: it goes on to the hold (scale from zero), which is not this queue's to judge."""
    if not candidates:
        return True
    if not len(q) and room(running, candidates, s) > 0:
        return True
    return q.under_share(tenant) and room(running, candidates, s, reserve=False) > 0


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

    def push(self, item: T, tenant: str, priority: Priority = "standard") -> list[T]:
        """Queue `item`; what it displaced, for the caller to refuse: nothing, or when the
        queue is full a request of the tenant holding the most of it (`_victim`), else `item`
        itself."""
        shed: list[T] = []
        if self._size >= self.max_waiting:
            victim = self._victim(tenant, priority)
            if victim is None:
                return [item]
            shed.append(victim)
        band = self._waiting[priority]
        if not any(tenant in b for b in self._waiting.values()):
            self._lift(tenant)
        band.setdefault(tenant, deque()).append(_Entry(item, tenant, self._seq))
        self._size += 1
        self._seq += 1
        return shed

    def _victim(self, tenant: str, priority: Priority) -> T | None:
        """Take out the request a full queue gives up for one of `tenant` (None: none): the
        newest of the tenant with the most waiting in the lowest class — when that class is
        lower than this request's, or it is the same and that tenant holds more of the queue
        than `tenant` would after the swap. Room in the queue is shared by count: a flood
        cannot hold it against a tenant with nothing waiting."""
        mine = sum(len(band.get(tenant, ())) for band in self._waiting.values())
        for band_priority in reversed(PRIORITIES):
            band = self._waiting[band_priority]
            if not band:
                continue
            top = max(band, key=lambda t: len(band[t]))
            lower = PRIORITIES.index(band_priority) > PRIORITIES.index(priority)
            hogs = band_priority == priority and top != tenant and len(band[top]) > mine + 1
            if not (lower or hogs):
                return None
            q = band[top]
            entry = q.pop()  # its newest: the one that waited least
            if not q:
                del band[top]
            self._size -= 1
            return entry.item
        return None

    def under_share(self, tenant: str) -> bool:
        """Whether `tenant` may take a reserved slot: nothing of it waits, and it received
        less service than the most served tenant (it is not the one flooding)."""
        if any(tenant in band for band in self._waiting.values()):
            return False
        return self.below_top(tenant)

    def below_top(self, tenant: str) -> bool:
        """Whether `tenant` received less service than the most served tenant."""
        others = [c for t, c in self.counters.items() if t != tenant]
        return bool(others) and self.counters.get(tenant, 0.0) < max(others)

    def _lift(self, tenant: str) -> None:
        """A tenant starts waiting: no credit for the time it was idle."""
        waiting = {t for b in self._waiting.values() for t in b}
        floor = (
            min(self.counters.get(t, 0.0) for t in waiting)
            if waiting
            else self.counters.get(self._last_dispatched or "", 0.0)
        )
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def head(self) -> tuple[Priority, str] | None:
        """The class and tenant of the next request to dispatch (None: nothing waits)."""
        for priority in PRIORITIES:
            band = self._waiting[priority]
            if band:
                return priority, min(
                    band, key=lambda t: (self.counters.get(t, 0.0), band[t][0].seq)
                )
        return None

    def pop(self) -> tuple[T, str] | None:
        """The next request to dispatch and its tenant (None: nothing waits)."""
        head = self.head()
        if head is None:
            return None
        priority, tenant = head
        band = self._waiting[priority]
        q = band[tenant]
        entry = q.popleft()
        if not q:
            del band[tenant]
        self._size -= 1
        self._last_dispatched = tenant
        return entry.item, tenant

    def releasable(self, running: int, candidates: Sequence[Candidate], s: Saturation) -> bool:
        """Whether the next waiting request may go now: room below the reserve, or room at
        all for a tenant served less than the most served (the reserve is its)."""
        head = self.head()
        if head is None:
            return False
        return room(running, candidates, s, reserve=not self.below_top(head[1])) > 0

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
