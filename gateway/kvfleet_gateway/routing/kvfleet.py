"""`kvfleet`: send each request where its first token is expected soonest.

For every replica, the request's expected completion time there =
    wait      queued prefill ahead of it (tokens this router sent whose first token has not
              come back, plus the engine's own queue beyond those, for other routers' work)
              ÷ prefill rate, plus the decode step in progress
  + prefill   the prompt tokens that will miss the replica's prefix cache ÷ prefill rate
              (weighted up: a miss also delays everyone queued behind it)
  + decode    max_tokens decode steps, each longer with more KV in use there
  + penalty   when the replica's free KV cannot hold the request (it would retract or wait).
The first three are its time to first token; the decode term is what balances load.
The expected cache hit comes from the engines' own KV events where a replica's stream is
live (`event_index.py`: exact), else from a prefix index of what was sent where, bounded by
each replica's KV capacity (`prefix_index.py`: approximate). Nothing special-cases a hot
prefix: once its owner's queue makes the wait longer than a cold prefill elsewhere, the next
request goes elsewhere (and that replica becomes a second owner), so a shared system prompt
spreads instead of piling up, and a replica whose batch has swollen stops attracting work
even for the prefixes it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet_gateway.routing.base import Candidate, RouteRequest
from kvfleet_gateway.routing.event_index import EventIndex
from kvfleet_gateway.routing.prefix_index import PrefixIndex
from kvfleet_gateway.routing.priors import DEFAULT_EFFICIENCY, GpuName, Priors, priors_for
from kvfleet_gateway.routing.throughput import RequestMix, replica_throughput
from kvfleet_kernel.schema import fld


@dataclass(frozen=True, kw_only=True)
class KvfleetTuning:
    """A replica's speed: priors from the model's config.json and the GPU's datasheet
    (`priors.py`), or set outright, that online calibration moves towards what the replicas
    show (`calibrate`)."""

    model_config: str | None = fld(
        None,
        "The model's Hugging Face config.json (or the directory holding it): its parameters and"
        " KV bytes per token set the priors. Unset: Llama-3.1-8B's.",
    )
    gpu: GpuName = fld("h100", "The engines' GPU, whose datasheet peaks set the priors.")
    tensor_parallel: int = fld(1, "GPUs per replica, for the priors.", minimum=1, maximum=64)
    peak_efficiency: float = fld(
        DEFAULT_EFFICIENCY,
        "Share of the GPU's peak FLOPs and bandwidth the priors assume a replica reaches.",
        minimum=0.01,
        maximum=1,
    )
    prefill_tokens_per_second: float | None = fld(
        None,
        "Uncached prompt tokens one replica prefills per second. Unset: from the model and the"
        " GPU's peak FLOPs.",
        minimum=1,
    )
    decode_step_base_s: float | None = fld(
        None,
        "A decode step's fixed part, in seconds: streaming the weights once, launch and"
        " sampling overhead. Unset: the weights' bytes over the GPU's bandwidth.",
        minimum=0,
        name="decodeStepBase",
    )
    kv_read_s_per_token: float | None = fld(
        None,
        "Seconds each token of KV in use adds to every decode step. Unset: the model's KV bytes"
        " per token over the GPU's bandwidth.",
        minimum=0,
        name="kvReadPerToken",
    )
    retraction_penalty_s: float = fld(
        1.0,
        "Seconds added when free KV cannot hold the request's prompt and output.",
        minimum=0,
        name="retractionPenalty",
    )
    # A miss costs more than this request's own prefill: it delays everything queued behind
    # it there, and pins an unshared copy of the prefix in KV, which stalls admission when
    # traffic bursts. 0 is pure per-request greedy TTFT, which spreads prefixes too eagerly
    # under bursts. 8: the best of 0, 1, 2, 4, 8 on workloads the routing report does not show
    # (`kvfleet bench routing-tuning`; 4 and 2 within 1.3% and 2.7% there).
    miss_weight: float = fld(8.0, "Extra weight on cache-missed prompt tokens.", minimum=0)
    # Ordinary fluctuation must not break prefix affinity; a hot prefix's owner swelling far
    # above the rest must.
    overload_tolerance: float = fld(
        0.25,
        "Share by which a replica's batch may exceed the candidates' mean before its slower"
        " decode counts against it.",
        minimum=0,
    )
    max_running_requests: int | None = fld(
        None,
        "The engines' batch slots (--max-running-requests): they bound a replica's batch in"
        " its throughput estimate. Unset: its KV cache does.",
        minimum=1,
    )
    calibrate: bool = fld(
        True,
        "Learn the prefill rate and the decode step from what replicas show (time to first"
        " token and between tokens of streamed responses), starting from the values above;"
        " false: use them as they are.",
    )


CALIBRATION_GAIN = 0.05
"""Weight of one observation in the log-space moving averages (about the last 20 requests)."""
MIN_CALIBRATION_MISS = 256
"""Uncached tokens below which a first token says more about overheads than prefill speed."""
MIX_REQUESTS = 100
"""Finished requests the request mix averages over (output lengths are heavy-tailed, and a
capacity plan wants the mix, not the last few requests)."""
MIN_MIX_SAMPLES = 20
"""Finished requests before the request mix (and the throughput from it) is reported."""


class KvfleetPolicy:
    name = "kvfleet"

    def __init__(
        self,
        tuning: KvfleetTuning | None = None,
        events: EventIndex | None = None,
        priors: Priors | None = None,
    ) -> None:
        self.tuning = t = tuning or KvfleetTuning()
        self.priors = priors or priors_for(
            t.model_config, t.gpu, t.tensor_parallel, t.peak_efficiency
        )
        """Where the model of a replica starts (a set tuning value overrides its part)."""
        p = self.priors
        self.decode_step_base_s = (
            p.decode_step_base_s if t.decode_step_base_s is None else t.decode_step_base_s
        )
        self.kv_read_s_per_token = (
            p.kv_read_s_per_token if t.kv_read_s_per_token is None else t.kv_read_s_per_token
        )
        self.index = PrefixIndex()
        self.events = events
        """Exact prefix state from KV events (None: approximate only)."""
        self._pending_tokens: dict[str, float] = {}
        self._pending_reqs: dict[str, int] = {}
        self._placed: dict[int, tuple[str, int, int | None]] = {}
        """id(request) → (replica, uncached tokens charged to its pending prefill, the first
        page reserved in the event index — the ones it did not hold — or None)."""
        self.prefill_rate = (
            p.prefill_tokens_per_second
            if t.prefill_tokens_per_second is None
            else t.prefill_tokens_per_second
        )
        """Learned from what replicas show (`observe`); starts at the prior."""
        self.step_scale = 1.0
        """Observed decode steps over the tuned model's: learned, starts at 1."""
        self._probes: dict[int, tuple[int, bool, int, int]] = {}
        """id(request) → (uncached tokens, replica idle at dispatch, its running requests as
        routing counts them, the engine's batch)."""
        self.batch_step_scale = 1.0
        """Observed decode steps over the tuned model's at the engine's own batch (its running
        count while it queues), where `step_scale` prices the in-flight count routing scores
        on: the throughput estimate's step."""
        self._avg_miss = 512.0
        self._avg_kv = 1024.0
        """Running average of prompt + max_tokens / 2: a request's KV footprint mid-decode."""
        self.mix: RequestMix | None = None
        """The mean finished request (as the engines' usage reports it): None until one."""
        self.mix_samples = 0

    def estimates(self, req: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        """Expected completion time of `req` on each candidate (seconds, comparable only)."""
        return self._score(req, candidates)[0]

    def _score(
        self, req: RouteRequest, candidates: Sequence[Candidate]
    ) -> tuple[list[float], list[int], list[int | None]]:
        """Scores, uncached-token counts and the pages the event index says each holds (None:
        its stream is not live), one per candidate (the hot path: keep it lean)."""
        t = self.tuning
        inv_rate = 1.0 / self.prefill_rate
        miss_factor = 1.0 + t.miss_weight
        per_running = self._avg_kv * self.kv_read_s_per_token * self.step_scale
        base, penalty = self.decode_step_base_s * self.step_scale, t.retraction_penalty_s
        max_tokens, block = req.max_tokens, req.block_tokens
        cap_hit = max(0, req.prompt_tokens - 1)
        keys = [c.key for c in candidates]
        exact: list[int | None] = (
            self.events.match(req.pages, req.page_tokens, keys)
            if self.events is not None and req.pages
            else [None] * len(keys)
        )
        if None in exact:  # some replica's stream is down: its hits are approximated
            approx = self.index.match(req.blocks, keys)
            hits = [
                a * block if e is None else e * req.page_tokens
                for a, e in zip(approx, exact, strict=True)
            ]
        else:
            hits = [e * req.page_tokens for e in exact if e is not None]
        running_of = [
            max(c.inflight_requests, c.engine.running_reqs if c.engine else 0) for c in candidates
        ]
        tolerated = (1.0 + t.overload_tolerance) * sum(running_of) / len(candidates)
        pending_tokens, pending_reqs = self._pending_tokens, self._pending_reqs
        scores: list[float] = []
        misses: list[int] = []
        for c, hit, running in zip(candidates, hits, running_of, strict=True):
            miss = req.prompt_tokens - min(hit, cap_hit)
            pending = pending_tokens.get(c.key, 0.0)
            e = c.engine
            if e is not None:
                # Other routers' queued work, which this one cannot see request by request.
                pending += max(0, e.queue_reqs - pending_reqs.get(c.key, 0)) * self._avg_miss
            # Decode speed from the exact, instant in-flight count (the scraped KV usage is a
            # second old and too noisy to weigh against a cache miss).
            step = base + running * per_running
            # Time to first token: queued prefill, its own (weighted) uncached prefill, and the
            # decode step in progress when it arrives ...
            score = (pending + miss * miss_factor) * inv_rate + step
            # ... then its output, one token per decode step: only a batch beyond the fleet's
            # ordinary spread counts, which keeps a hot prefix's owner from swelling.
            if running > tolerated:
                score += max_tokens * (running - tolerated) * per_running
            if e is not None and e.max_total_tokens * (1.0 - e.token_usage) - pending < (
                miss + max_tokens
            ):
                score += penalty  # would not fit in free KV: it would wait or retract
            scores.append(score)
            misses.append(miss)
        return scores, misses, exact

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate]) -> str:
        scores, misses, exact = self._score(req, candidates)
        best = 0
        for i in range(1, len(candidates)):  # lowest score; ties: fewer in flight, then key
            a, b = candidates[i], candidates[best]
            if (scores[i], a.inflight_requests, a.key) < (scores[best], b.inflight_requests, b.key):
                best = i
        c, miss = candidates[best], misses[best]
        if c.engine is not None:
            self.index.set_capacity(c.key, c.engine.max_total_tokens // req.block_tokens)
        self._release(req)  # a retry replaces the earlier placement
        idle = self._pending_reqs.get(c.key, 0) == 0 and (
            c.engine is None or c.engine.queue_reqs == 0
        )
        running = max(c.inflight_requests, c.engine.running_reqs if c.engine else 0)
        batch = running
        if c.engine is not None and c.engine.queue_reqs > 0:
            # A queueing engine's batch is full: what is in flight beyond it waits, and this
            # request will decode in a batch of the engine's size, not of the in-flight count.
            batch = c.engine.running_reqs
        self._probes[id(req)] = (miss, idle, running, batch)
        held = exact[best]  # None: routed on the approximate index
        self._placed[id(req)] = (c.key, miss, held)
        self._pending_tokens[c.key] = self._pending_tokens.get(c.key, 0.0) + miss
        self._pending_reqs[c.key] = self._pending_reqs.get(c.key, 0) + 1
        self._avg_miss += 0.05 * (miss - self._avg_miss)
        self._avg_kv += 0.05 * (req.prompt_tokens + req.max_tokens / 2 - self._avg_kv)
        if held is not None and self.events is not None:
            # Only the pages it does not hold yet: those are what its prefill will add. (The
            # approximate index is not fed for a replica whose events are live: should its
            # stream drop, it falls back to what it last learned, an underestimate.)
            self.events.reserve(c.key, req.pages[held:])
        else:
            self.index.insert(c.key, req.blocks)
        return c.key

    def _release(self, req: RouteRequest) -> None:
        placed = self._placed.pop(id(req), None)
        if placed is not None:
            key, miss, reserved_from = placed
            if self.events is not None and reserved_from is not None:
                self.events.release(key, req.pages[reserved_from:])
            self._pending_tokens[key] = max(0.0, self._pending_tokens.get(key, 0.0) - miss)
            self._pending_reqs[key] = max(0, self._pending_reqs.get(key, 0) - 1)

    def on_first_token(self, req: RouteRequest, key: str) -> None:
        self._release(req)

    def observe(self, req: RouteRequest, key: str, ttft_s: float, itl_s: float | None) -> None:
        """The request's replica answered in `ttft_s` and then `itl_s` per token (mean; None
        for fewer than two output tokens): calibrate the prefill rate from requests that met
        an idle replica (their first token is their own prefill) and the decode step from
        every request, each a slow moving average in log space around its prior."""
        probe = self._probes.pop(id(req), None)
        if probe is None or not self.tuning.calibrate:
            return
        miss, idle, running, batch = probe
        step = self._model_step(running)
        if itl_s is not None and itl_s > 0:
            self.step_scale = _calibrated(self.step_scale, itl_s / step)
            self.batch_step_scale = _calibrated(
                self.batch_step_scale, itl_s / self._model_step(batch)
            )
        if idle and miss >= MIN_CALIBRATION_MISS:
            prefill_s = ttft_s - step * self.step_scale
            if prefill_s > 0:
                rate = min(1e7, max(100.0, miss / prefill_s))
                self.prefill_rate *= (rate / self.prefill_rate) ** CALIBRATION_GAIN

    def _model_step(self, running: int) -> float:
        """The tuned model's decode step with `running` requests of the mean KV footprint."""
        return self.decode_step_base_s + running * self._avg_kv * self.kv_read_s_per_token

    def observe_work(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        """A finished request's usage, as its engine reported it: folded into the request mix
        (a plain mean over the first `MIX_REQUESTS`, then a moving one over about as many)."""
        done = RequestMix(
            max(0, prompt_tokens - cached_tokens), output_tokens, prompt_tokens + output_tokens / 2
        )
        self.mix_samples += 1
        gain = 1.0 / min(self.mix_samples, MIX_REQUESTS)
        self.mix = done if self.mix is None else self.mix.moved(done, gain)

    def throughput(self, pool_tokens: int) -> float | None:
        """Requests per second a replica whose KV cache holds `pool_tokens` completes at most,
        at the recent request mix and the calibrated speeds (`throughput.py`); None before
        `MIN_MIX_SAMPLES` requests have finished."""
        if self.mix is None or self.mix_samples < MIN_MIX_SAMPLES or pool_tokens <= 0:
            return None
        return replica_throughput(
            self.mix,
            self.prefill_rate,
            self.decode_step_base_s * self.batch_step_scale,
            self.kv_read_s_per_token * self.batch_step_scale,
            pool_tokens,
            self.tuning.max_running_requests,
        )

    def on_finished(self, req: RouteRequest, key: str) -> None:
        self._release(req)
        self._probes.pop(id(req), None)  # never observed (not streamed, failed): forget it

    def on_removed(self, key: str) -> None:
        self.index.remove(key)
        if self.events is not None:
            self.events.remove(key)
        self._pending_tokens.pop(key, None)
        self._pending_reqs.pop(key, None)


def _calibrated(scale: float, observed_ratio: float) -> float:
    """`scale` moved `CALIBRATION_GAIN` of the way (in log space) towards an observed ratio of
    a measured step over the model's, clipped to 1/8..8 (one odd response moves it little)."""
    ratio = min(8.0, max(0.125, observed_ratio))
    moved: float = scale * (ratio / scale) ** CALIBRATION_GAIN
    return moved
