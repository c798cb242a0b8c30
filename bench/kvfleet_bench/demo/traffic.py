"""The demo's three tenants, as OpenAI SDK clients of the gateway: multi-turn support
conversations sharing a system prompt, document searches sharing one long prompt, and a
trial tenant on a small token budget. Poisson arrivals at each phase's rate."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import openai

from kvfleet_bench.demo.timeline import TenantStats

Messages = list[dict[str, str]]


class Conversations:
    """Support chats that go on: each turn adds the user's question and the reply."""

    def __init__(self, system: str, rng: random.Random, words: list[str], n: int = 8) -> None:
        self.system, self.rng, self.words = system, rng, words
        self.turns: list[Messages] = [[] for _ in range(n)]

    def next(self) -> tuple[int, Messages]:
        i = self.rng.randrange(len(self.turns))
        question = " ".join(self.rng.choice(self.words) for _ in range(self.rng.randint(6, 20)))
        history = self.turns[i][-6:]  # the last three exchanges
        return i, [
            {"role": "system", "content": self.system},
            *history,
            {"role": "user", "content": question},
        ]

    def answered(self, i: int, messages: Messages, reply: str) -> None:
        self.turns[i] = [*messages[1:], {"role": "assistant", "content": reply}]


async def one_request(
    client: openai.AsyncOpenAI,
    model: str,
    messages: Messages,
    max_tokens: int,
    stats: TenantStats,
) -> str | None:
    """Stream one chat; record TTFT, tokens, usage or the refusal; the reply text."""
    stats.sent += 1
    start = time.monotonic()
    parts: list[str] = []
    try:
        stream = await client.chat.completions.create(  # type: ignore[call-overload]
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        resets_at = int(stream.response.headers.get("x-kvfleet-budget-resets-at", "0"))
        first = True
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first:
                    now = time.monotonic()
                    stats.ttft.append((now, now - start))
                    first = False
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                stats.bill(chunk.usage.prompt_tokens + chunk.usage.completion_tokens, resets_at)
                stats.tokens.append((time.monotonic(), chunk.usage.completion_tokens))
    except openai.RateLimitError as exc:
        code = str(exc.code or "rate_limited")
        stats.refused[code] = stats.refused.get(code, 0) + 1
        return None
    except openai.APIStatusError as exc:
        code = f"{exc.status_code} {exc.code or ''}".strip()
        stats.failed[code] = stats.failed.get(code, 0) + 1
        return None
    except openai.APIError as exc:
        name = type(exc).__name__
        stats.failed[name] = stats.failed.get(name, 0) + 1
        return None
    stats.ok += 1
    return "".join(parts)


async def drive(
    rate: Callable[[float], float],
    peak: float,
    send: Callable[[], Any],
    elapsed: Callable[[], float],
    until_s: float,
    rng: random.Random,
    inflight: set[asyncio.Task[Any]],
) -> None:
    """Poisson arrivals at `rate(t)` requests/s (never over `peak`) until `until_s`; each
    `send()` a task. Thinning: candidates come at the peak rate and each is kept with
    probability rate/peak at its own time. (A gap drawn at the rate of the moment it was
    drawn overshoots a rise: a 5 s gap drawn at a steady 0.2/s slept through a burst at
    1.5/s, and the trial tenant of a 30 s run sent 3 requests where 13 were due.)"""
    if peak <= 0:
        return
    while (t := elapsed()) < until_s:
        await asyncio.sleep(min(rng.expovariate(peak), until_s - t))
        t = elapsed()
        if t >= until_s:
            break
        if rng.random() * peak < rate(t):
            task = asyncio.create_task(send())
            inflight.add(task)
            task.add_done_callback(inflight.discard)
