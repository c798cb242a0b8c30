"""What every routing policy sees and promises: one protocol, shared by the gateway and the
fleet simulator (which drives the very same policy objects in virtual time)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """A request as a router sees it. Identity matters: callbacks pass the same object back."""

    model: str
    units: Sequence[int] | str
    """What prefix matching runs on: the rendered prompt text (gateway) or token ids (sim)."""
    blocks: tuple[int, ...]
    """Chained hashes of consecutive `block_tokens`-sized blocks of the prompt (`blocks.py`)."""
    prompt_tokens: int
    max_tokens: int
    block_tokens: int = 32
    """Tokens per block (`blocks.BLOCK_TOKENS`; text blocks are about as many tokens)."""
    pages: tuple[int, ...] = ()
    """The engine's own hashes of the prompt's whole pages (`kv_events.hashing`), when the
    gateway knows the prompt's token ids; empty otherwise."""
    page_tokens: int = 0
    """Tokens per page of `pages` (the engines' advertised block size)."""


@dataclass(frozen=True, slots=True)
class EngineSignals:
    """Engine metrics scraped from a replica's /metrics (None until the first scrape)."""

    queue_reqs: int
    running_reqs: int
    token_usage: float
    max_total_tokens: int
    cache_hit_rate: float
    age_s: float
    """How old the scrape is."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One routable replica, as the caller knows it at decision time."""

    key: str
    inflight_requests: int
    """Requests this router sent there that have not finished (instant, exact)."""
    inflight_tokens: int
    """Prompt + max_tokens of those requests."""
    engine: EngineSignals | None


class Policy(Protocol):
    name: str

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate]) -> str:
        """The `key` of the chosen candidate (`candidates` is never empty). Calling it again
        for the same request (a retry elsewhere) replaces the earlier placement."""
        ...

    def on_first_token(self, req: RouteRequest, key: str) -> None:
        """The replica started answering: its prefill for this request is done."""
        ...

    def observe(self, req: RouteRequest, key: str, ttft_s: float, itl_s: float | None) -> None:
        """The replica's timing for the request, before `on_finished`: time from dispatch to
        the first token, and the mean time between tokens (None: fewer than two). Only for
        streamed responses, whose first token is timed."""
        ...

    def on_finished(self, req: RouteRequest, key: str) -> None:
        """The request ended there (any outcome)."""
        ...

    def on_removed(self, key: str) -> None:
        """The replica left the set: forget what was learned about it."""
        ...


class Stateless:
    """For policies that learn nothing from a request's progress."""

    def on_first_token(self, req: RouteRequest, key: str) -> None:
        return None

    def observe(self, req: RouteRequest, key: str, ttft_s: float, itl_s: float | None) -> None:
        return None

    def on_finished(self, req: RouteRequest, key: str) -> None:
        return None

    def on_removed(self, key: str) -> None:
        return None
