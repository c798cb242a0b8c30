"""`round_robin`: each replica in turn. The baseline every other policy must beat."""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet_gateway.routing.base import Candidate, RouteRequest, Stateless


class RoundRobin(Stateless):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate]) -> str:
        ordered = sorted(candidates, key=lambda c: c.key)
        choice = ordered[self._turn % len(ordered)]
        self._turn += 1
        return choice.key
