"""Workloads at the token level: what each request asks for, and multi-turn follow-ups.

Prompts are built lazily, one request at a time, so 50,000 requests of 2,000-token prompts do
not sit in memory at once. Token ids are random (seeded): two prompts share a prefix only
when the workload says they do.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvfleet_sim.datasets import random_lengths, random_token_ids, sharegpt_lengths

WorkloadKind = Literal["generated-shared-prefix", "hot-tenant", "random", "sharegpt", "multi-turn"]
WORKLOADS: tuple[str, ...] = (
    "generated-shared-prefix",
    "hot-tenant",
    "random",
    "sharegpt",
    "multi-turn",
)


class ArrivalProcess(Protocol):
    """When requests arrive: a `RateTrace`, or a workload file's stages."""

    def arrivals(self, n: int, rng: random.Random) -> list[float]: ...


@dataclass(frozen=True)
class WorkloadSpec:
    kind: WorkloadKind = "generated-shared-prefix"
    num_requests: int = 1024
    seed: int = 1
    # generated-shared-prefix: bench_serving's defaults
    gsp_num_groups: int = 64
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    gsp_output_len: int = 256
    # random
    input_len: int = 1024
    output_len: int = 256
    range_ratio: float = 1.0
    hot_share: float = 0.5
    """hot-tenant: the share of requests that carry the one hot system prompt."""
    # multi-turn chat
    turns: int = 4
    """Turns per conversation; the prompt of turn k holds every earlier turn and reply."""
    think_time_s: float = 5.0
    """Mean pause (exponential) between a reply and the user's next message."""
    lora_adapters: int = 0
    """Each request runs with one of this many LoRA adapters (0: the base model)."""
    lora_zipf: float = 1.0
    """Adapter popularity: the k-th most popular is asked for in proportion to 1/k^s."""


@dataclass(eq=False)
class Conversation:
    """Chat state carried between turns (token ids of the whole history so far)."""

    history: list[int]
    turns_left: int
    turn_lengths: list[tuple[int, int]] = field(default_factory=list)


@dataclass(eq=False)
class Arrival:
    time: float
    prompt_ids: list[int]
    max_new_tokens: int
    tenant: str = "default"
    conversation: Conversation | None = None
    adapter: str | None = None
    """The LoRA adapter it asks for (None: the base model)."""
    group: int = -1
    """Shared-prefix group (or conversation id): which requests share a prefix, for reports."""


class Workload:
    """Iterates arrivals in time order; multi-turn follow-ups come from `follow_up`."""

    def __init__(self, spec: WorkloadSpec, trace: ArrivalProcess, vocab_size: int) -> None:
        if spec.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        self.spec, self.trace, self.vocab = spec, trace, vocab_size
        self.rng = random.Random(spec.seed)

    def __iter__(self) -> Iterator[Arrival]:
        arrivals = self._arrivals()
        n = self.spec.lora_adapters
        if n <= 0:
            yield from arrivals
            return
        # Its own stream: the prompts and times are those of the workload without adapters.
        rng = random.Random(self.spec.seed * 7919 + 17)
        names = [f"adapter-{k}" for k in range(n)]
        weights = [1.0 / (k + 1) ** self.spec.lora_zipf for k in range(n)]
        for arrival in arrivals:
            arrival.adapter = rng.choices(names, weights)[0]
            yield arrival

    def _arrivals(self) -> Iterator[Arrival]:
        s, rng = self.spec, self.rng
        if s.kind == "multi-turn":
            n_conv = max(1, s.num_requests // s.turns)
            times = self.trace.arrivals(n_conv, rng)
            for i, t in enumerate(times):
                lengths = sharegpt_lengths(rng, s.turns)
                conv = Conversation(
                    history=[],
                    turns_left=s.turns,
                    turn_lengths=[(p.input_len, p.output_len) for p in lengths],
                )
                yield self._turn(t, conv, i)
            return
        times = self.trace.arrivals(s.num_requests, rng)
        if s.kind == "hot-tenant":
            # One tenant's system prompt is `hot_share` of all traffic; the rest spread over
            # the other groups, as generated-shared-prefix does.
            systems = [
                random_token_ids(rng, s.gsp_system_prompt_len, self.vocab)
                for _ in range(s.gsp_num_groups)
            ]
            for t in times:
                g = 0 if rng.random() < s.hot_share else rng.randrange(1, s.gsp_num_groups)
                question = random_token_ids(rng, s.gsp_question_len, self.vocab)
                yield Arrival(
                    t,
                    systems[g] + question,
                    s.gsp_output_len,
                    tenant="hot" if g == 0 else "other",
                    group=g,
                )
            return
        if s.kind == "generated-shared-prefix":
            systems = [
                random_token_ids(rng, s.gsp_system_prompt_len, self.vocab)
                for _ in range(s.gsp_num_groups)
            ]
            per_round = s.gsp_num_groups * s.gsp_prompts_per_group
            order: list[int] = []
            for i, t in enumerate(times):
                if i % per_round == 0:  # bench_serving shuffles the group × prompt grid
                    order = [
                        g for g in range(s.gsp_num_groups) for _ in range(s.gsp_prompts_per_group)
                    ]
                    rng.shuffle(order)
                g = order[i % per_round]
                question = random_token_ids(rng, s.gsp_question_len, self.vocab)
                yield Arrival(t, systems[g] + question, s.gsp_output_len, group=g)
            return
        if s.kind == "random":
            pairs = random_lengths(rng, s.num_requests, s.input_len, s.output_len, s.range_ratio)
        elif s.kind == "sharegpt":
            pairs = sharegpt_lengths(rng, s.num_requests)
        else:
            raise ValueError(f"unknown workload {s.kind!r}")
        for t, p in zip(times, pairs, strict=True):
            yield Arrival(t, random_token_ids(rng, p.input_len, self.vocab), p.output_len)

    def _turn(self, t: float, conv: Conversation, group: int) -> Arrival:
        n_in, n_out = conv.turn_lengths[self.spec.turns - conv.turns_left]
        conv.history = conv.history + random_token_ids(self.rng, n_in, self.vocab)
        conv.turns_left -= 1
        return Arrival(t, conv.history, n_out, conversation=conv, group=group)

    def follow_up(self, done: Arrival, output_ids: list[int], now: float) -> Arrival | None:
        """The next turn of a conversation, after the user reads the reply and thinks."""
        conv = done.conversation
        if conv is None or conv.turns_left <= 0:
            return None
        conv.history = conv.history + output_ids
        return self._turn(
            now + self.rng.expovariate(1.0 / self.spec.think_time_s), conv, done.group
        )
