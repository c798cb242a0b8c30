"""`random`: a replica drawn uniformly — what a stateless load balancer in front of the
engines does; a baseline beside round robin."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvfleet_gateway.routing.base import Candidate, RouteRequest, Stateless


class RandomChoice(Stateless):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate]) -> str:
        return self._rng.choice(sorted(c.key for c in candidates))
