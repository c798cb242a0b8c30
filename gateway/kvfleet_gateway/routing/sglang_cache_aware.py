"""`sglang_cache_aware`: sglang-router 0.3.2's cache_aware policy, re-implemented faithfully.

With its defaults: when loads are imbalanced (max − min > 64 and max > 1.5 × min, load =
this router's in-flight requests per worker) send to the least loaded; otherwise, if the
best prefix match in the approximate tree covers more than 30% of the request, send to the
worker that holds it, else to the worker with the smallest tree. Every decision inserts the
request into the chosen worker's tree. (Descriptions of the router say "least loaded"
for the low-match case; the 0.3.2 source picks the smallest tree, and so does this.)
The tree's periodic LRU trim (60 s, 2^26 nodes) never triggers at these scales and is
not modelled.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet_gateway.routing.approx_tree import ApproxTree
from kvfleet_gateway.routing.base import Candidate, RouteRequest

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5


class SglangCacheAware:
    name = "sglang_cache_aware"

    def __init__(self) -> None:
        self.tree = ApproxTree()

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate]) -> str:
        for c in candidates:
            if c.key not in self.tree.sizes:
                self.tree.add_tenant(c.key)
        loads = {c.key: c.inflight_requests for c in candidates}
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > BALANCE_ABS_THRESHOLD and hi > lo * BALANCE_REL_THRESHOLD:
            key = min(candidates, key=lambda c: (c.inflight_requests, c.key)).key
        else:
            matched, tenant = self.tree.prefix_match(req.units)
            rate = matched / len(req.units) if len(req.units) else 0.0
            if rate > CACHE_THRESHOLD and tenant in loads:
                key = tenant
            else:
                sizes = self.tree.sizes
                key = min(candidates, key=lambda c: (sizes.get(c.key, 0), c.key)).key
        self.tree.insert(req.units, key)
        return key

    def on_first_token(self, req: RouteRequest, key: str) -> None:
        return None

    def observe(self, req: RouteRequest, key: str, ttft_s: float, itl_s: float | None) -> None:
        return None  # sglang-router learns nothing from timing

    def on_finished(self, req: RouteRequest, key: str) -> None:
        return None

    def on_removed(self, key: str) -> None:
        self.tree.remove_tenant(key)
