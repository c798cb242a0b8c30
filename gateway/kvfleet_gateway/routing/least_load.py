"""`least_load`: the replica with the least work, by the engine's queue when scraped, else by
this router's own in-flight requests; ties broken by in-flight tokens."""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet_gateway.routing.base import Candidate, RouteRequest, Stateless


def load_of(c: Candidate) -> tuple[int, int]:
    engine = c.engine
    queued = engine.queue_reqs + engine.running_reqs if engine is not None else 0
    # Own in-flight is instant; the engine's numbers also count other gateways' requests.
    return max(queued, c.inflight_requests), c.inflight_tokens


class LeastLoad(Stateless):
    name = "least_load"

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate]) -> str:
        return min(candidates, key=lambda c: (*load_of(c), c.key)).key
