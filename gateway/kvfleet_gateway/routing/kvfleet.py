"""`kvfleet`: send each request where its first token is expected soonest.

For every replica, estimated TTFT =
    wait      queued prefill ahead of it (tokens this router sent whose first token has not
              come back, plus the engine's own queue beyond those, for other routers' work)
              ÷ prefill rate, plus the decode step in progress (longer with more running)
  + prefill   the prompt tokens that will miss the replica's prefix cache ÷ prefill rate
  + penalty   when the replica's free KV cannot hold the request (it would retract or wait).
The expected cache hit comes from a prefix index of what was sent where, bounded by each
replica's KV capacity. Nothing special-cases a hot prefix: once its owner's queue makes the
wait longer than a cold prefill elsewhere, the next request goes elsewhere (and that replica
becomes a second owner), so a shared system prompt spreads instead of piling up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet_gateway.routing.base import Candidate, RouteRequest
from kvfleet_gateway.routing.prefix_index import PrefixIndex


@dataclass(frozen=True)
class KvfleetTuning:
    """The replica's speed, as the operator knows it from the model and GPU."""

    prefill_tokens_per_second: float = 20_000.0
    """Uncached prompt tokens one replica prefills per second."""
    decode_step_base_s: float = 0.010
    """A decode step with an empty batch (weights streamed once)."""
    decode_step_per_request_s: float = 0.00005
    """What each running request adds to a decode step (its KV read, sampling)."""
    retraction_penalty_s: float = 1.0
    """Added when free KV cannot hold the request's prompt and output."""


class KvfleetPolicy:
    name = "kvfleet"

    def __init__(self, tuning: KvfleetTuning | None = None) -> None:
        self.tuning = tuning or KvfleetTuning()
        self.index = PrefixIndex()
        self._pending_tokens: dict[str, float] = {}
        self._pending_reqs: dict[str, int] = {}
        self._placed: dict[int, tuple[str, int]] = {}
        """id(request) → (replica, uncached tokens charged to its pending prefill)."""
        self._avg_miss = 512.0

    def estimates(self, req: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        t = self.tuning
        rate = t.prefill_tokens_per_second
        keys = [c.key for c in candidates]
        matched = self.index.match(req.blocks, keys)
        out = []
        for c, blocks in zip(candidates, matched, strict=True):
            hit = min(blocks * req.block_tokens, max(0, req.prompt_tokens - 1))
            miss = req.prompt_tokens - hit
            pending = self._pending_tokens.get(c.key, 0.0)
            own_waiting = self._pending_reqs.get(c.key, 0)
            running = max(0, c.inflight_requests - own_waiting)
            e = c.engine
            if e is not None:
                pending += max(0, e.queue_reqs - own_waiting) * self._avg_miss
                running = max(running, e.running_reqs)
            score = (
                (pending + miss) / rate
                + t.decode_step_base_s
                + (running * t.decode_step_per_request_s)
            )
            if e is not None:
                free = e.max_total_tokens * (1.0 - e.token_usage) - pending
                if free < miss + req.max_tokens:
                    score += t.retraction_penalty_s
            out.append(score)
        return out

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate]) -> str:
        scores = self.estimates(req, candidates)
        best = min(
            range(len(candidates)),
            key=lambda i: (scores[i], candidates[i].inflight_requests, candidates[i].key),
        )
        c = candidates[best]
        if c.engine is not None:
            self.index.set_capacity(c.key, c.engine.max_total_tokens // req.block_tokens)
        matched = self.index.match(req.blocks, [c.key])[0]
        miss = req.prompt_tokens - min(matched * req.block_tokens, max(0, req.prompt_tokens - 1))
        self._release(req)  # a retry replaces the earlier placement
        self._placed[id(req)] = (c.key, miss)
        self._pending_tokens[c.key] = self._pending_tokens.get(c.key, 0.0) + miss
        self._pending_reqs[c.key] = self._pending_reqs.get(c.key, 0) + 1
        self._avg_miss += 0.05 * (miss - self._avg_miss)
        self.index.insert(c.key, req.blocks)
        return c.key

    def _release(self, req: RouteRequest) -> None:
        placed = self._placed.pop(id(req), None)
        if placed is not None:
            key, miss = placed
            self._pending_tokens[key] = max(0.0, self._pending_tokens.get(key, 0.0) - miss)
            self._pending_reqs[key] = max(0, self._pending_reqs.get(key, 0) - 1)

    def on_first_token(self, req: RouteRequest, key: str) -> None:
        self._release(req)

    def on_finished(self, req: RouteRequest, key: str) -> None:
        self._release(req)

    def on_removed(self, key: str) -> None:
        self.index.remove(key)
        self._pending_tokens.pop(key, None)
        self._pending_reqs.pop(key, None)
