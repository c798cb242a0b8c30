"""LoRA adapters across the fleet: which replica holds which adapter, the gateway's choice of
replicas for a request with one, and what a load costs.

The choice is the gateway's own `affinity` (replicas holding the adapter; others with an
empty queue when every holder has requests waiting); holding, least-recently-used eviction of
an idle adapter at the per-replica bound and loading on demand are what the gateway's
`AdapterManager` does over HTTP. An adapter-unaware router (`aware=False`) offers every
replica, as a router that does not know adapters would: the chosen replica loads what it
lacks all the same. A load delays the request by its disk read (`kvfleet_sim.lora`); the
engine's scheduler then charges its GPU copy-in, the adapters-per-batch bound and mixing.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet_gateway.lora import affinity, eviction, queue_of
from kvfleet_gateway.routing import Candidate


@dataclass
class FleetAdapters:
    aware: bool
    """The gateway's adapter-aware routing (False: a router that does not know adapters)."""
    max_per_replica: int
    """Adapters one replica holds (the gateway's maxAdaptersPerReplica)."""
    load_s: float
    """Seconds one load takes (reading the adapter's weights)."""
    held: dict[str, OrderedDict[str, None]] = field(default_factory=dict)
    """Replica → its adapters, least recently used first."""
    in_use: Counter[tuple[str, str]] = field(default_factory=Counter)
    loads: int = 0
    chooser: Callable[[str, list[Candidate]], list[Candidate]] | None = None
    """Another router's adapter-aware filter, instead of the gateway's (a baseline's)."""

    def offer(self, adapter: str, candidates: list[Candidate]) -> list[Candidate]:
        if self.chooser is not None:
            return self.chooser(adapter, candidates)
        if not self.aware:
            return candidates
        held = [adapter in self.held.get(c.key, ()) for c in candidates]
        waiting = [queue_of(c) for c in candidates]
        return [candidates[i] for i in affinity(held, waiting)]

    def place(self, replica: str, adapter: str) -> float:
        """`replica` takes a request with `adapter`: the seconds before it can start (its
        load, when the replica does not hold it; the least recently used idle adapter makes
        room at the bound)."""
        held = self.held.setdefault(replica, OrderedDict())
        self.in_use[(replica, adapter)] += 1
        if adapter in held:
            held.move_to_end(adapter)
            return 0.0
        busy = {n for n in held if self.in_use.get((replica, n))}
        recency = {n: float(i) for i, n in enumerate(held)}  # least recently used first
        victim = eviction(list(held), busy, recency, self.max_per_replica)
        if victim is not None:
            del held[victim]
        held[adapter] = None
        self.loads += 1
        return self.load_s

    def in_use_on(self, replica: str) -> set[str]:
        """The adapters of the requests `replica` has in flight."""
        return {a for (r, a), n in self.in_use.items() if r == replica and n > 0}

    def ended(self, replica: str, adapter: str) -> None:
        key = (replica, adapter)
        self.in_use[key] -= 1
        if self.in_use[key] <= 0:
            del self.in_use[key]
