"""Offline throughput: every prompt submitted at once, as `sglang.bench_offline_throughput`,
or at a Poisson rate, as `sglang.bench_serving --request-rate R` measures it."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import asdict, dataclass
from typing import Literal

from kvfleet_sim.config import EngineConfig
from kvfleet_sim.costmodel import DEFAULT_PROFILE
from kvfleet_sim.datasets import random_lengths, random_token_ids, sharegpt_lengths
from kvfleet_sim.engine import Engine, VirtualClock
from kvfleet_sim.measured import DEFAULT_TRUTH
from kvfleet_sim.request import Request

Dataset = Literal["random", "sharegpt"]


@dataclass(frozen=True)
class OfflineSpec:
    dataset: Dataset = "random"
    num_prompts: int = 1000
    input_len: int = 1024
    output_len: int = 1024
    range_ratio: float = 1.0
    """`--random-range-ratio`: lengths uniform in [len × R, len]; 1.0 = fixed lengths."""
    seed: int = 1
    request_rate: float | None = None
    """`--request-rate`: Poisson arrivals at this many requests/s; None = all at once."""


@dataclass(frozen=True)
class OfflineResult:
    duration_s: float
    num_prompts: int
    input_tokens: int
    output_tokens: int
    output_throughput: float
    input_throughput: float
    total_throughput: float
    request_throughput: float
    max_total_num_tokens: int
    max_running_requests: int
    retractions: int
    steps: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def run_offline(
    config: EngineConfig,
    spec: OfflineSpec,
    profile: str = DEFAULT_PROFILE,
    truth: str = DEFAULT_TRUTH,
) -> OfflineResult:
    if spec.num_prompts < 1:
        raise ValueError("num_prompts must be >= 1")
    rng = random.Random(spec.seed)
    if spec.dataset == "sharegpt":
        lengths = sharegpt_lengths(rng, spec.num_prompts)
    elif spec.dataset == "random":
        lengths = random_lengths(
            rng, spec.num_prompts, spec.input_len, spec.output_len, spec.range_ratio
        )
    else:
        raise ValueError(f"unknown dataset {spec.dataset!r}")
    clock = VirtualClock()
    engine = Engine(config, clock, profile=profile, truth=truth)
    vocab = config.model.vocab_size
    arrivals = _arrival_times(rng, len(lengths), spec.request_rate)
    # Random ids: no two prompts share a prefix, as with SGLang's random dataset.
    pending = deque(
        Request(
            rid=f"offline-{i}",
            prompt_ids=random_token_ids(rng, pair.input_len, vocab),
            max_new_tokens=pair.output_len,
            arrival_time=arrivals[i],
            seed=i,
        )
        for i, pair in enumerate(lengths)
    )
    duration = _run(engine, clock, pending)
    inp = sum(p.input_len for p in lengths)
    outp = sum(p.output_len for p in lengths)
    return OfflineResult(
        duration_s=duration,
        num_prompts=len(lengths),
        input_tokens=inp,
        output_tokens=outp,
        output_throughput=outp / duration,
        input_throughput=inp / duration,
        total_throughput=(inp + outp) / duration,
        request_throughput=len(lengths) / duration,
        max_total_num_tokens=engine.layout.max_total_num_tokens,
        max_running_requests=engine.layout.max_running_requests,
        retractions=engine.scheduler.retracted_total,
        steps=engine.counters.steps,
    )


def _arrival_times(rng: random.Random, n: int, rate: float | None) -> list[float]:
    """bench_serving's schedule: exponential gaps at `rate`, or every request at time 0."""
    if rate is None:
        return [0.0] * n
    if rate <= 0:
        raise ValueError("request_rate must be > 0")
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _run(engine: Engine, clock: VirtualClock, pending: deque[Request]) -> float:
    """Drive the engine in virtual time, submitting each request when it arrives; the
    duration ends with the last completion, as bench_serving's does."""
    while True:
        while pending and pending[0].arrival_time <= clock.t:
            engine.submit(pending.popleft())
        step = engine.begin_step()
        if step is None:
            if not pending:
                return clock.t
            clock.t = pending[0].arrival_time  # idle until the next arrival
            continue
        clock.t = step.start + step.duration
        engine.end_step(step)
