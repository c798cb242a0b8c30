"""`oracle`: the routing limit, for the simulator only. It reads every engine's true prefix
cache, queue and memory (which no real router can) and picks the replica where the first
token would come soonest by the engine's own cost model."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvfleet_gateway.routing import Candidate, RouteRequest
from kvfleet_sim.costmodel import StepShape
from kvfleet_sim.engine import Engine

RETRACTION_PENALTY_S = 1.0


class OraclePolicy:
    name = "oracle"

    def __init__(self, engines: Callable[[], Mapping[str, Engine]]) -> None:
        self._engines = engines
        self._peeked: dict[str, int] = {}

    def _ttft(self, engine: Engine, req: RouteRequest) -> float:
        s = engine.scheduler
        cache = s.cache
        units = req.units
        assert not isinstance(units, str)
        hit = min(cache.peek(units), req.prompt_tokens - 1)
        miss = req.prompt_tokens - hit
        pending = 0
        for w in s.waiting:
            if w.rid not in self._peeked:  # what each queued request will find cached
                self._peeked[w.rid] = cache.peek(w.prompt_ids)
            pending += w.fill_len - min(self._peeked[w.rid], w.fill_len - 1)
        if s.chunked is not None:
            pending += s.chunked.fill_len - s.chunked.kv_len
        cost = engine.cost
        chunk = engine.layout.chunked_prefill_size
        total = pending + miss
        full, rest = divmod(total, chunk)
        prefill = full * cost.step_time(
            StepShape(prefill_tokens=chunk, prefill_seqs=1, prefill_attn_pairs=chunk * chunk / 2)
        )
        if rest:
            prefill += cost.step_time(
                StepShape(prefill_tokens=rest, prefill_seqs=1, prefill_attn_pairs=rest * rest / 2)
            )
        running = [r.kv_len for r in s.running]
        decode = (
            cost.step_time(StepShape(decode_seqs=len(running), decode_ctx_tokens=sum(running)))
            if running
            else 0.0
        )
        penalty = 0.0
        if s.available_tokens - pending < miss + req.max_tokens:
            penalty = RETRACTION_PENALTY_S
        return prefill + decode + penalty

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate]) -> str:
        engines = self._engines()
        return min(
            candidates, key=lambda c: (self._ttft(engines[c.key], req), c.inflight_requests, c.key)
        ).key

    def on_first_token(self, req: RouteRequest, key: str) -> None:
        return None

    def observe(self, req: RouteRequest, key: str, ttft_s: float, itl_s: float | None) -> None:
        return None  # it reads the engines' true state

    def on_finished(self, req: RouteRequest, key: str) -> None:
        if len(self._peeked) > 100_000:
            self._peeked.clear()

    def on_removed(self, key: str) -> None:
        return None
