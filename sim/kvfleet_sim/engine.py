"""One engine: the scheduler plus the cost model, driven by a clock it does not own.

The engine never sleeps and never reads wall time itself. A driver asks it for the next
step (`begin_step`), lets `duration` pass on its clock, then closes the step (`end_step`):
the fleet simulator does this in virtual time (discrete events), the HTTP server in real
time with asyncio (`realtime.py`). Same code, same numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvfleet_sim.config import EngineConfig, EngineLayout, derive_layout
from kvfleet_sim.costmodel import DEFAULT_PROFILE, CostModel
from kvfleet_sim.lora import MIX_COST
from kvfleet_sim.measured import DEFAULT_TRUTH, build_cost_model
from kvfleet_sim.request import Request
from kvfleet_sim.scheduler import Batch, Scheduler, StepOutcome
from kvfleet_sim.tokenizer import Tokenizer


class Clock(Protocol):
    def now(self) -> float:
        """Engine time in seconds (simulated GPU time)."""
        ...


class VirtualClock:
    """Discrete-event time: moves only when the simulator says so."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t


class RealClock:
    """Wall time scaled: `time_scale` wall seconds pass per simulated second."""

    def __init__(self, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = time_scale
        self._t0 = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._t0) / self.time_scale

    def wall_seconds(self, sim_seconds: float) -> float:
        return sim_seconds * self.time_scale


@dataclass(slots=True)
class Step:
    batch: Batch
    start: float
    duration: float


@dataclass
class EngineCounters:
    """Cumulative totals, the source of SGLang's `_total` counters."""

    requests: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    busy_seconds: float = 0.0
    steps: int = 0
    recent_gen: list[tuple[float, int]] = field(default_factory=list)


@dataclass(frozen=True)
class EngineLoad:
    """A point-in-time view, the shape of one `/v1/loads` entry."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    max_running_requests: int
    token_usage: float
    cache_hit_rate: float
    gen_throughput: float
    num_retracted_reqs: int

    @property
    def utilization(self) -> float:
        """Share of the binding resource in use: KV pool or request slots."""
        return max(self.token_usage, self.num_running_reqs / max(1, self.max_running_requests))


StepListener = Callable[["Engine", Step, StepOutcome], None]

GEN_THROUGHPUT_WINDOW_S = 5.0  # like SGLang's decode log interval, in time rather than steps


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        clock: Clock,
        *,
        profile: str = DEFAULT_PROFILE,
        truth: str = DEFAULT_TRUTH,
        cost_model: CostModel | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config
        self.layout: EngineLayout = derive_layout(config)
        self.clock = clock
        # Measured GPU timings where the triple is profiled, else the profile's roofline.
        self.cost: CostModel = cost_model or build_cost_model(self.layout, profile, truth)
        self.tokenizer = tokenizer or Tokenizer(config.model.vocab_size)
        self.scheduler = Scheduler(self.layout, self.tokenizer.generate_ids)
        self.counters = EngineCounters()
        self.listeners: list[StepListener] = []
        self.aborted_listeners: list[Callable[[Request], None]] = []

    def submit(self, req: Request) -> None:
        self.scheduler.submit(req)
        self.counters.requests += 1

    def abort(self, req: Request) -> None:
        self.scheduler.abort(req)

    def begin_step(self) -> Step | None:
        now = self.clock.now()
        batch, aborted = self.scheduler.plan(now)
        for req in aborted:
            self.counters.aborted += 1
            for cb in self.aborted_listeners:
                cb(req)
        if batch is None:
            return None
        duration = self.cost.step_time(batch.shape)
        if self.scheduler.max_loras:
            adapters = len({r.adapter for r in batch.reqs if r.adapter is not None})
            duration = duration * (1 + MIX_COST * max(0, adapters - 1)) + batch.lora_copy_s
        return Step(batch=batch, start=now, duration=duration)

    def end_step(self, step: Step) -> StepOutcome:
        now = self.clock.now()
        outcome = self.scheduler.complete(step.batch, now)
        c = self.counters
        c.steps += 1
        c.busy_seconds += step.duration
        c.generation_tokens += len(outcome.emitted)
        if step.batch.is_prefill:
            c.cached_tokens += step.batch.cached_tokens
            # Placed KV (disaggregated decode) was computed by a prefill engine, not here.
            c.prompt_tokens += sum(r.prompt_len for r in outcome.first_tokens if not r.prefilled)
        if outcome.emitted:
            c.recent_gen.append((now, len(outcome.emitted)))
            if len(c.recent_gen) > 256:
                del c.recent_gen[:128]
        for listener in self.listeners:
            listener(self, step, outcome)
        return outcome

    def load(self) -> EngineLoad:
        s = self.scheduler
        now = self.clock.now()
        window = [(t, n) for t, n in self.counters.recent_gen if now - t <= GEN_THROUGHPUT_WINDOW_S]
        span = max(now - window[0][0], 1e-9) if len(window) > 1 else 0.0
        gen = sum(n for _, n in window[1:]) / span if span else 0.0
        return EngineLoad(
            num_running_reqs=s.num_running,
            num_waiting_reqs=len(s.waiting),
            num_used_tokens=s.used_tokens,
            max_total_num_tokens=s.capacity,
            max_running_requests=s.max_running,
            token_usage=s.used_tokens / s.capacity if s.capacity else 0.0,
            cache_hit_rate=s.last_hit_rate,
            gen_throughput=gen,
            num_retracted_reqs=sum(1 for r in s.waiting if r.retractions),
        )

    def run_until_idle(self, clock: VirtualClock, limit_s: float = float("inf")) -> float:
        """Drive this engine alone in virtual time until nothing is left (offline mode)."""
        while True:
            step = self.begin_step()
            if step is None:
                return clock.t
            clock.t = step.start + step.duration
            self.end_step(step)
            if clock.t > limit_s:
                return clock.t
