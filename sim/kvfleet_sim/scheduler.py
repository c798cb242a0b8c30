"""SGLang's scheduler, step by step, without a GPU.

Each step either runs a prefill ("extend") batch built from the waiting queue, or one decode
step over every running request, never both (SGLang's default: no mixed chunked prefill).

* Admission (SGLang's `PrefillAdder`): a request joins the prefill batch while the KV pool,
  after reserving `new_token_ratio` × the remaining output of everything already running,
  can hold its uncached input plus its own max_new_tokens (clipped at 4096); the batch is
  capped by `max_prefill_tokens`, `chunked_prefill_size` and `max_running_requests`. A prompt
  longer than the chunk budget is cut, and its next chunk leads the next prefill batch.
* After each prefill the computed tokens enter the radix cache (`cache_unfinished_req`), so
  requests arriving later share them while the first one still decodes.
* Decode: when the pool cannot hold one more token per request, requests with the fewest
  output tokens (longest inputs first on ties) are retracted to the waiting queue, their KV
  freed, and `new_token_ratio` is reset from what remains; otherwise it decays each step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet_sim.config import EngineLayout
from kvfleet_sim.costmodel import StepShape
from kvfleet_sim.lora import copy_in_seconds
from kvfleet_sim.radix import DisabledCache, RadixCache
from kvfleet_sim.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Request

# SGLang constants (sglang/srt/managers/scheduler.py, schedule_policy.py, environ).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
CLIP_MAX_NEW_TOKENS = 4096
RETRACT_DECODE_STEPS = 20
LPM_QUEUE_LIMIT = 128  # above this many waiting requests SGLang falls back from lpm to fcfs


class QueueFullError(RuntimeError):
    """`--max-queued-requests` reached: the server answers 503."""


class InputTooLongError(ValueError):
    """An input longer than the KV pool (or the context) can hold: the server answers 400."""


@dataclass(slots=True)
class Batch:
    """One planned step."""

    is_prefill: bool
    reqs: list[Request]
    extend_lens: list[int] = field(default_factory=list)
    shape: StepShape = field(default_factory=StepShape)
    cached_tokens: int = 0
    """Prefill only: input tokens served from the cache in this batch."""
    lora_copy_s: float = 0.0
    """Seconds of adapter weights copied into the GPU pool before this step runs."""


@dataclass(slots=True)
class StepOutcome:
    """What a finished step produced, for the driver to deliver."""

    batch: Batch
    emitted: list[Request] = field(default_factory=list)
    """Requests that got one more token (first tokens included)."""
    first_tokens: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)


@dataclass(slots=True)
class _PrefillBudget:
    """What one prefill batch may still take, and the shape it has so far."""

    input: int
    """`max_prefill_tokens` left."""
    chunk: int
    """`chunked_prefill_size` left."""
    pairs: float = 0.0
    ctx: int = 0


OutputIds = Callable[[int, int], list[int]]
"""(seed, count) -> the first `count` generated token ids of a request."""


class Scheduler:
    def __init__(self, layout: EngineLayout, output_ids: OutputIds) -> None:
        cfg = layout.config
        self.layout = layout
        self.capacity = layout.max_total_num_tokens
        self.max_running = layout.max_running_requests
        self.chunk_size = layout.chunked_prefill_size
        self.max_prefill_tokens = cfg.max_prefill_tokens
        self.max_queued = cfg.max_queued_requests
        self.policy = cfg.schedule_policy
        self.cache_enabled = not cfg.disable_radix_cache
        self.cache: RadixCache = (
            RadixCache(cfg.page_size) if self.cache_enabled else DisabledCache(cfg.page_size)
        )
        self._output_ids = output_ids
        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * cfg.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.new_token_ratio_decay = (
            self.init_new_token_ratio - self.min_new_token_ratio
        ) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.chunked: Request | None = None
        self.req_tokens = 0
        """KV slots held by requests outside the cache (their uncached tail)."""
        self.last_hit_rate = 0.0
        self.retracted_total = 0
        self.max_loras = cfg.max_loras_per_batch
        self.gpu_loras: OrderedDict[str, None] = OrderedDict()
        """Adapters in the GPU pool (as many slots as adapters per batch), oldest use first."""
        self._copy_in_s = copy_in_seconds(cfg.model, cfg.lora_rank) if self.max_loras else 0.0

    # ---- memory ---------------------------------------------------------------------------
    @property
    def free_tokens(self) -> int:
        return self.capacity - self.cache.total_size - self.req_tokens

    @property
    def available_tokens(self) -> int:
        """Free plus evictable: what an allocation can get."""
        return self.free_tokens + self.cache.evictable_size

    @property
    def used_tokens(self) -> int:
        """SGLang's num_used_tokens: pool minus (free + evictable)."""
        return self.capacity - self.available_tokens

    def _alloc(self, n: int) -> None:
        short = n - self.free_tokens
        if short > 0:
            self.cache.evict(short)
        if n > self.free_tokens:
            raise RuntimeError("KV pool over-committed: admission budget violated")
        self.req_tokens += n

    def _release(self, req: Request) -> None:
        """Give back the request's own KV and its lock on the cached prefix."""
        self.req_tokens -= req.kv_len - req.prefix_len
        if req.node is not None:
            self.cache.dec_lock_ref(req.node)
        req.node, req.kv_len, req.prefix_len = None, 0, 0

    def _fill_ids(self, req: Request, length: int) -> list[int]:
        if length <= req.prompt_len:
            return req.prompt_ids[:length]
        need = length - req.prompt_len
        if len(req.output_ids) < need:
            req.output_ids = self._output_ids(req.seed, req.output_len)
        return req.prompt_ids + req.output_ids[:need]

    def _cache_computed(self, req: Request) -> None:
        """SGLang's cache_{unfinished,finished}_req: hand the computed tokens to the tree."""
        if not self.cache_enabled:
            return
        key = self._fill_ids(req, req.kv_len)
        self.cache.insert(key, req.cache_salt)
        match = self.cache.match_prefix(key, req.cache_salt)
        self.cache.inc_lock_ref(match.node)
        if req.node is not None:
            self.cache.dec_lock_ref(req.node)
        # Tokens the tree already had were duplicates: freed. The rest moved into the tree.
        self.req_tokens -= req.kv_len - req.prefix_len
        req.node, req.prefix_len = match.node, match.length
        self.req_tokens += req.kv_len - match.length  # unaligned tail (page_size > 1) stays ours

    # ---- requests -------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue a request. As SGLang's scheduler does, an input the pool could never hold is
        refused, and `max_new_tokens` is cut so input and output fit the pool together: a
        request alone on the engine then always finishes."""
        if self.max_queued is not None and len(self.waiting) >= self.max_queued:
            raise QueueFullError("the waiting queue is full")
        longest = self.layout.max_req_input_len
        if req.prompt_len > longest:
            raise InputTooLongError(
                f"Input length ({req.prompt_len} tokens) exceeds the maximum allowed length "
                f"({longest} tokens). Use a shorter input."
            )
        req.max_new_tokens = min(req.max_new_tokens, longest - req.prompt_len)
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """Mark for removal; state is cleaned at the next step boundary (never mid-step)."""
        req.aborted = True

    def _purge_aborted(self, now: float) -> list[Request]:
        gone: list[Request] = []
        if any(r.aborted for r in self.waiting):
            keep: deque[Request] = deque()
            for r in self.waiting:
                (gone if r.aborted else keep).append(r)
            self.waiting = keep
        if any(r.aborted for r in self.running):
            gone_running = [r for r in self.running if r.aborted]
            self.running = [r for r in self.running if not r.aborted]
            gone.extend(gone_running)
        if self.chunked is not None and self.chunked.aborted:
            gone.append(self.chunked)
            self.chunked = None
        for r in gone:
            self._release(r)
            r.finish_reason, r.finish_time = FINISH_ABORT, now
        return gone

    @property
    def num_running(self) -> int:
        return len(self.running) + (1 if self.chunked is not None else 0)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and self.chunked is None

    # ---- planning -------------------------------------------------------------------------
    def plan(self, now: float) -> tuple[Batch | None, list[Request]]:
        """Choose the next step. Returns the batch (None when idle) and purged aborts."""
        aborted = self._purge_aborted(now)
        batch = self._plan_prefill(now)
        if batch is None and self.running:
            batch = self._plan_decode()
        if batch is None and not self.running and self.chunked is None:
            self.new_token_ratio = self.init_new_token_ratio
        return batch, aborted

    def _order_waiting(self) -> None:
        if self.policy == "lpm" and self.cache_enabled and 1 < len(self.waiting) <= LPM_QUEUE_LIMIT:
            hits = {
                id(r): self.cache.match_prefix(self._fill_ids(r, r.fill_len), r.cache_salt).length
                for r in self.waiting
            }
            self.waiting = deque(sorted(self.waiting, key=lambda r: -hits[id(r)]))

    def _reserved(self, req: Request, ratio: float = 1.0) -> float:
        """KV a request may still need for its output: what admission holds back for it."""
        return min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) * ratio

    def _plan_prefill(self, now: float) -> Batch | None:
        if not self.waiting and self.chunked is None:
            return None
        if len(self.running) >= self.max_running and self.chunked is None:
            return None
        batch = Batch(is_prefill=True, reqs=[])
        # What the pool must keep for requests already decoding (SGLang's new_token_ratio
        # estimate of their remaining output) and for those admitted below (all of theirs).
        # The rest is read live: locking a cached prefix makes it unevictable at once, so a
        # figure taken before the loop would count the same tokens twice.
        held = sum(self._reserved(r, self.new_token_ratio) for r in self.running)
        budget = _PrefillBudget(self.max_prefill_tokens, self.chunk_size)
        if self.chunked is not None:
            req = self.chunked
            # The next chunk, as far as the pool can hold it now; decodes that outgrew their
            # estimate may have taken the rest (they retract, or finish, and free it).
            extend = min(req.fill_len - req.kv_len, budget.chunk, self.available_tokens)
            if extend <= 0:
                return None
            self.chunked = None
            self._add(batch, req, extend, budget)
            held += self._reserved(req)
            if req.kv_len < req.fill_len:
                self.chunked = req
        else:
            self._order_waiting()
        while self.waiting and self.chunked is None:
            if len(self.running) + len(batch.reqs) >= self.max_running:
                break
            if budget.input <= 0 or budget.chunk <= 0:
                break
            if self.max_loras and not self._lora_head(batch):
                break
            added = self._admit_head(now, batch, budget, held)
            if added is None:
                break
            held += added
            self._lora_joined(batch, batch.reqs[-1])
        if not batch.reqs:
            return None
        computed = sum(batch.extend_lens)
        batch.shape = StepShape(
            prefill_tokens=computed,
            prefill_seqs=len(batch.reqs),
            prefill_attn_pairs=budget.pairs,
            prefill_ctx_tokens=budget.ctx,
        )
        total = computed + batch.cached_tokens
        self.last_hit_rate = batch.cached_tokens / total if total else 0.0
        return batch

    def batch_adapters(self, batch: Batch | None = None) -> set[str]:
        """The distinct adapters of the running requests (and of `batch`)."""
        reqs = self.running + (batch.reqs if batch is not None else [])
        return {r.adapter for r in reqs if r.adapter is not None}

    def _lora_head(self, batch: Batch) -> bool:
        """Put at the head of the queue the first request whose adapter fits the batch (at
        most `max_loras` distinct adapters: the others are skipped, as SGLang does); False
        when none fits."""
        active = self.batch_adapters(batch)
        assert self.max_loras is not None
        for i, req in enumerate(self.waiting):
            if req.adapter is None or req.adapter in active or len(active) < self.max_loras:
                if i:
                    del self.waiting[i]
                    self.waiting.appendleft(req)
                return True
        return False

    def _lora_joined(self, batch: Batch, req: Request) -> None:
        """An adapter not in the GPU pool is copied in (the least recently used, not running,
        makes room)."""
        if req.adapter is None:
            return
        if req.adapter in self.gpu_loras:
            self.gpu_loras.move_to_end(req.adapter)
            return
        batch.lora_copy_s += self._copy_in_s
        self.gpu_loras[req.adapter] = None
        active = self.batch_adapters(batch)
        assert self.max_loras is not None
        for name in list(self.gpu_loras):
            if len(self.gpu_loras) <= self.max_loras:
                break
            if name not in active:
                del self.gpu_loras[name]

    def _admit_head(
        self, now: float, batch: Batch, budget: _PrefillBudget, held: float
    ) -> float | None:
        """Admit the head of the queue into `batch` if the pool can hold its input and its
        output reservation; the reservation it adds, or None (the batch is complete)."""
        req = self.waiting[0]
        fill = self._fill_ids(req, req.fill_len)
        match = self.cache.match_prefix(fill, req.cache_salt)
        prefix = min(match.length, req.fill_len - 1)  # the last token is always computed
        if prefix < match.length:
            match = self.cache.match_prefix(fill[:prefix], req.cache_salt)
        extend = req.fill_len - match.length
        if extend > budget.input and batch.reqs and not req.prefilled:
            return None
        self.cache.inc_lock_ref(match.node)  # before the check: the prefix stops being free
        reserve = self._reserved(req)
        # Its input and its whole output reservation must fit. Alone on the engine they
        # always do: `submit` cut max_new_tokens so input and output fit the pool.
        if extend + reserve > self.available_tokens - held:
            self.cache.dec_lock_ref(match.node)
            return None
        self.waiting.popleft()
        req.node, req.prefix_len, req.kv_len = match.node, match.length, match.length
        if req.output_len == 0 and not req.prefilled:
            req.cached_tokens = match.length
            batch.cached_tokens += match.length
        if req.scheduled_time is None:
            req.scheduled_time = now
        if req.prefilled:  # its KV came from a prefill engine: placed, not computed
            self._alloc(extend)
            batch.reqs.append(req)
            batch.extend_lens.append(0)
            req.kv_len += extend
            return reserve
        self._add(batch, req, min(extend, budget.chunk), budget)
        if req.kv_len < req.fill_len:
            self.chunked = req
        return reserve

    def _add(self, batch: Batch, req: Request, extend: int, budget: _PrefillBudget) -> None:
        self._alloc(extend)
        batch.reqs.append(req)
        batch.extend_lens.append(extend)
        budget.pairs += StepShape.prefill_pairs(extend, req.kv_len)
        budget.ctx += req.kv_len
        req.kv_len += extend
        budget.input -= extend
        budget.chunk -= extend

    def _plan_decode(self) -> Batch | None:
        needed = len(self.running)
        if self.available_tokens < needed:
            self._retract()
            needed = len(self.running)
            if not needed:
                return None
        else:
            self.new_token_ratio = max(
                self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio
            )
        self._alloc(needed)
        ctx = 0
        for r in self.running:
            r.kv_len += 1
            ctx += r.kv_len
        return Batch(
            is_prefill=False,
            reqs=list(self.running),
            shape=StepShape(decode_seqs=needed, decode_ctx_tokens=ctx),
        )

    def _retract(self) -> None:
        """Evict requests back to the queue until the rest can decode RETRACT_DECODE_STEPS more."""
        order = sorted(self.running, key=lambda r: (r.output_len, -r.prompt_len), reverse=True)
        retracted: list[Request] = []
        while order and self.available_tokens < len(order) * RETRACT_DECODE_STEPS:
            if len(order) == 1 and self.available_tokens >= 1:
                break
            victim = order.pop()
            self._release(victim)
            victim.retractions += 1
            victim.prefilled = False  # its KV is gone: computed again on this engine
            victim.output_ids = self._output_ids(victim.seed, victim.output_len)
            retracted.append(victim)
        self.running = order
        self.waiting.extend(retracted)
        self.retracted_total += len(retracted)
        decoded = sum(r.output_len for r in order)
        max_new = sum(r.max_new_tokens for r in order) or 1
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(order)) / max_new)

    # ---- completion -----------------------------------------------------------------------
    def complete(self, batch: Batch, now: float) -> StepOutcome:
        """Apply a finished step: sample tokens, finish, cache, promote prefills to decode."""
        out = StepOutcome(batch=batch)
        for req in batch.reqs:
            if req.aborted or req.finished:
                continue
            if batch.is_prefill and req is self.chunked:
                continue  # more chunks to go: no token yet
            if req.max_new_tokens == 0:  # prefill only (SGLang answers with no tokens)
                req.finish_reason, req.finish_time = FINISH_LENGTH, now
                out.finished.append(req)
                continue
            req.output_len += 1
            req.last_token_time = now
            out.emitted.append(req)
            if req.first_token_time is None:
                req.first_token_time = now
                out.first_tokens.append(req)
            if req.stop_at is not None and req.output_len >= req.stop_at:
                req.finish_reason = FINISH_STOP
            elif req.output_len >= req.max_new_tokens:
                req.finish_reason = FINISH_LENGTH
            if req.finished:
                req.finish_time = now
                out.finished.append(req)
        for req in out.finished:
            if self.cache_enabled:
                self._cache_computed(req)
            self._release(req)
        if batch.is_prefill:
            for req in batch.reqs:
                if req is self.chunked or req.finished or req.aborted:
                    continue
                self._cache_computed(req)
                self.running.append(req)
        elif out.finished:
            self.running = [r for r in self.running if not r.finished]
        return out

    def flush_cache(self) -> bool:
        """`/flush_cache`: only allowed when idle, as in SGLang."""
        if not self.idle:
            return False
        self.cache.reset()
        return True
