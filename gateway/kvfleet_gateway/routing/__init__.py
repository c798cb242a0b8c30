"""Routing policies: pick one backend for a request. One protocol, one module per policy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvfleet_gateway.backends import Backend


@dataclass(frozen=True, slots=True)
class RouteInfo:
    model: str
    prompt: str
    """The rendered prompt text (for prefix-aware policies)."""
    estimated_tokens: int


class Router(Protocol):
    name: str

    def choose(self, info: RouteInfo, candidates: Sequence[Backend]) -> Backend:
        """Pick one of `candidates` (never empty)."""
        ...


class LeastInflight:
    """Fewest requests in flight from this gateway; ties broken by fewer in-flight tokens."""

    name = "least_inflight"

    def choose(self, info: RouteInfo, candidates: Sequence[Backend]) -> Backend:
        return min(candidates, key=lambda b: (b.inflight_requests, b.inflight_tokens, b.url))


POLICIES: dict[str, type] = {"least_inflight": LeastInflight}


def make_router(policy: str) -> Router:
    try:
        return POLICIES[policy]()  # type: ignore[no-any-return]
    except KeyError:
        raise ValueError(
            f"unknown routing policy {policy!r}; known: {', '.join(POLICIES)}"
        ) from None
