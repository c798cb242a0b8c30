"""One request's progress through the proxy: filled in as it goes, read at the end for
billing (`billed_usage`), timing (the routing policy's calibration) and the access log."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet_gateway.backends import Backend
from kvfleet_gateway.config import CostConfig, Price
from kvfleet_gateway.inbound import ClientRequest
from kvfleet_gateway.metrics import Usage
from kvfleet_gateway.routing import RouteRequest


@dataclass
class Exchange:
    """One request's progress, filled in as it goes; read at the end for billing and logs."""

    tenant: str
    req: ClientRequest
    route: RouteRequest
    started: float = field(default_factory=time.monotonic)
    dispatched_at: float = 0.0
    """When the request was sent to the engine that answered (after any hold and retry)."""
    backend: Backend | None = None
    status: int = 0
    first_token_at: float | None = None
    prev_token_at: float = 0.0
    last_token_at: float | None = None
    usage: Usage | None = None
    content_chunks: int = 0
    content_chars: int = 0
    client_gone: bool = False
    last_event: bytes = b""
    on_first_token: Callable[[], None] | None = None
    engine_accepted: bool = False
    """The request reached an engine (it may have done the work): billed even with no counts."""
    adapter: str | None = None
    """The LoRA adapter it runs with (its base model is `route.model`)."""
    load_charge: int = 0
    """Tokens billed for the adapter load this request caused (`lora.loadChargeTokens`,
    within its reservation)."""
    price: Price | None = None
    """What its model's tokens cost (cost budgets and the cost metric)."""
    gpu_cost: CostConfig | None = None
    """Its pool's GPU cost model (None: the gateway's `cost`)."""
    deadline: float = 0.0
    """Monotonic time by which the response must begin (a non-streaming one: be whole)."""
    """An engine answered 200 and started on the request (its prefill is under way)."""

    def billed_usage(self) -> Usage:
        """The engine's counts when it reported any (in every chunk of a stream), clamped to
        the reservation; else an estimate of the work the engine was given."""
        req = self.req
        if self.usage is not None:
            u = self.usage
            prompt = min(max(0, u.prompt_tokens), req.prompt_bound)
            completion = min(max(0, u.completion_tokens), req.max_tokens)
            cached = min(max(0, u.cached_tokens), prompt)
            return Usage(prompt, completion, cached)
        if not self.engine_accepted:
            return Usage(0, 0)  # no engine took it: nothing to charge
        # Accepted but no counts (a non-streaming reply that timed out, a cut before the first
        # chunk, an engine that reports none): what the engine did is unknown, so the safe
        # side, the bound the tenant reserved. (Streams carry counts in every chunk.)
        return Usage(req.prompt_bound, req.max_tokens)

    def token_arrived(self) -> None:
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            if self.on_first_token is not None:
                self.on_first_token()
        self.prev_token_at = self.last_token_at or now
        self.last_token_at = now
        self.content_chunks += 1
