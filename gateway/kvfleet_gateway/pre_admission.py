"""What the gateway decides before it reads a request's body, so that a refused request
costs microseconds, not the CPU of decoding a megabyte (a tenant whose budget was used up once
made every other tenant wait a second per request it sent).

From the headers alone, per tenant of this gateway:

* a refusal that stands — the requests-per-minute window is full until its reset, the token
  budget is spent for the rest of its period — is repeated at once, with its Retry-After (an
  administrator's change to the tenant's limits ends it);
* its requests in flight here against `maxConcurrent` (a lower bound of the count across
  gateways, so refusing at it is always right);
* its share of body parsing: a bucket of `requests.bodyBytesPerSecond` (twice
  `maxBodyBytes` deep) that a body's `Content-Length` must fit before it is read (a chunked
  body is charged as it was read);
* a compressed body, unless `requests.compressedBodies`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from kvfleet_gateway.config import Limits
from kvfleet_gateway.errors import GatewayError
from kvfleet_gateway.inbound import PROMPT_OVERHEAD
from kvfleet_gateway.limiter import Decision, over_concurrency

LEAST_RESERVATION = PROMPT_OVERHEAD + 1
"""The fewest tokens any request reserves: a budget with less left than this is spent."""


@dataclass(frozen=True)
class Standing:
    """A refusal that holds until `until` (time.time()) for these limits."""

    until: float
    decision: Decision
    limits: Limits


@dataclass
class _Bucket:
    level: float
    at: float


@dataclass
class PreAdmission:
    body_bytes_per_second: float
    depth: float
    """The bucket's size, in bytes."""
    standing: dict[str, Standing] = field(default_factory=dict)
    inflight: Counter[str] = field(default_factory=Counter)
    """Admitted requests of each tenant in flight through this gateway."""
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def refusal(self, tenant: str, limits: Limits, now: float) -> Standing | None:
        """The tenant's standing refusal, if one still holds for its current limits."""
        held = self.standing.get(tenant)
        if held is None:
            return None
        if held.until <= now or held.limits != limits:
            del self.standing[tenant]
            return None
        return held

    def remember(self, tenant: str, limits: Limits, decision: Decision, now: float) -> None:
        """Keep a store's refusal that waiting alone ends: a full rate window, or a budget
        spent for the rest of its period (spending only grows until the period ends)."""
        wait = decision.retry_after_s
        if decision.admitted or wait is None:
            return
        budget = decision.quota.budget
        spent = (
            decision.reason == "budget" and budget is not None and (budget.left < LEAST_RESERVATION)
        )
        if decision.reason == "requests" or spent:
            self.standing[tenant] = Standing(now + wait, decision, limits)

    def over_concurrency(self, tenant: str, limits: Limits) -> GatewayError | None:
        if limits.max_concurrent is not None and self.inflight[tenant] >= limits.max_concurrent:
            return GatewayError(
                429,
                over_concurrency(limits.max_concurrent),
                "requests",
                "rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        return None

    def take_body(self, tenant: str, size: int, now: float) -> GatewayError | None:
        """Charge `size` body bytes to the tenant's bucket, or say when there will be room."""
        bucket = self._buckets.setdefault(tenant, _Bucket(self.depth, now))
        bucket.level = min(
            self.depth, bucket.level + (now - bucket.at) * self.body_bytes_per_second
        )
        bucket.at = now
        if size > bucket.level and bucket.level < self.depth:
            wait = math.ceil((size - bucket.level) / self.body_bytes_per_second)
            return GatewayError(
                429,
                f"this key sent more request-body bytes than this gateway parses for one "
                f"tenant ({self.body_bytes_per_second:,.0f} per second)",
                "requests",
                "rate_limit_exceeded",
                headers={"Retry-After": str(max(1, wait))},
            )
        bucket.level -= size
        return None
