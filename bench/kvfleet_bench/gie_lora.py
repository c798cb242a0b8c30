"""A baseline that knows adapters: the Gateway API Inference Extension's LoRA routing, written
here from its published logic (kubernetes-sigs/gateway-api-inference-extension, the endpoint
picker's default decision tree in `pkg/epp/scheduling`), not from its code.

Its endpoint picker reads each model server's scraped metrics: the queue, the KV cache usage
and the adapters of its running and waiting requests, with the most it may run at once. The
tree: replicas whose queue is at most `queue_threshold` (128 by default) go through the
adapter-affinity filter, then the least-queue and least-KV-cache filters; if none is that
short, least queue first, then affinity, then least KV cache. The affinity filter splits the
replicas into those already serving the request's adapter (running or waiting) and those
with room for one more adapter, and keeps the first group with probability
`affinity_threshold` (0.999 by default), else the second (whichever is not empty when one
is). Each least-X filter keeps the replicas within one n-th of the spread above the least.
A replica is picked at random among the rest.

Mapped onto the fleet simulator: a replica's adapters in use are the adapters of the
requests it has in flight (the simulator does not tell running from waiting, so an adapter
in both counts once); its room is `max_per_replica` (SGLang's --max-loras-per-batch, what
vLLM's max LoRAs is); queue and KV usage are the scraped signals every router here sees.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet_gateway.routing import Candidate

QUEUE_THRESHOLD = 128
"""The published default of the low-queue filter (requests waiting)."""
AFFINITY_THRESHOLD = 0.999
"""The published default probability of keeping the replicas already serving the adapter."""


@dataclass
class GieLoraFilter:
    in_use: Callable[[str], set[str]]
    """Replica → the adapters of its requests in flight."""
    max_active: int
    queue_threshold: int = QUEUE_THRESHOLD
    affinity_threshold: float = AFFINITY_THRESHOLD
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def __call__(self, adapter: str, candidates: list[Candidate]) -> list[Candidate]:
        short = [c for c in candidates if _queue(c) <= self.queue_threshold]
        if short:
            kept = _least(self._affinity(adapter, short), _queue)
        else:
            kept = self._affinity(adapter, _least(candidates, _queue))
        return _least(kept, _kv)

    def _affinity(self, adapter: str, candidates: list[Candidate]) -> list[Candidate]:
        serving, room = [], []
        for c in candidates:
            adapters = self.in_use(c.key)
            if adapter in adapters:
                serving.append(c)
            elif len(adapters) < self.max_active:
                room.append(c)
        if serving and room:
            return serving if self.rng.random() < self.affinity_threshold else room
        # Neither group: the tree goes on with what it had (a filter that empties fails).
        return serving or room or candidates


def _queue(c: Candidate) -> float:
    return float(c.engine.queue_reqs if c.engine is not None else c.inflight_requests)


def _kv(c: Candidate) -> float:
    return c.engine.token_usage if c.engine is not None else 0.0


def _least(candidates: list[Candidate], value: Callable[[Candidate], float]) -> list[Candidate]:
    """The replicas within one n-th of the spread above the least (n: how many there are)."""
    values = [value(c) for c in candidates]
    low, high = min(values), max(values)
    limit = low + (high - low) / len(candidates)
    return [c for c, v in zip(candidates, values, strict=True) if v <= limit]
