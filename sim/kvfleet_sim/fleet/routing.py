"""The Router protocol the fleet simulator drives, and two baselines for the harness itself.

A router sees what a gateway sees: each replica's last scraped engine load (possibly
stale), the gateway's own in-flight count for it (instant), and the request (tokens,
max_new_tokens, tenant). The gateway's policies (round robin, least load, cache-aware)
plug in through this same protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvfleet_sim.engine import EngineLoad


@dataclass(frozen=True, slots=True)
class ReplicaView:
    index: int
    name: str
    load: EngineLoad
    """Last scraped engine metrics (as old as the scrape interval)."""
    scraped_at: float
    inflight_requests: int
    """Requests the router sent there that have not finished (the gateway's own count)."""
    inflight_tokens: int
    """Prompt + max_new tokens of those requests."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    prompt_ids: Sequence[int]
    max_new_tokens: int
    tenant: str = "default"


class Router(Protocol):
    name: str

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView], now: float) -> int:
        """Return the `index` of the chosen replica (one of `replicas`, never empty)."""
        ...

    def on_finish(self, replica: int, request: RouteRequest, now: float) -> None:
        """Called when a request the router placed has finished."""
        ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView], now: float) -> int:
        choice = replicas[self._next % len(replicas)]
        self._next += 1
        return choice.index

    def on_finish(self, replica: int, request: RouteRequest, now: float) -> None:
        return None


class LeastInflight:
    """Fewest requests in flight from this router (ties: lowest index)."""

    name = "least_inflight"

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView], now: float) -> int:
        return min(replicas, key=lambda r: (r.inflight_requests, r.index)).index

    def on_finish(self, replica: int, request: RouteRequest, now: float) -> None:
        return None
