"""Admission control: rate windows, concurrency leases and token budgets, per tenant.

The algorithm, shared by both stores (this in-memory one and `redis_store`'s Lua):

* **Rates** (requests and tokens per minute): a sliding window of 60 one-second buckets.
  Admission counts the buckets of the last 60 s, so a burst at a window edge cannot pass
  twice the limit (at most one bucket, 1/60 of the window, of slack).
* **Concurrency**: a lease per request, with a TTL renewed by heartbeats while the request
  runs; a crashed gateway's leases expire instead of leaking.
* **Budget**: tokens per fixed period (aligned to the epoch). Admission reserves estimated
  prompt + max_tokens atomically against `used + reserved`; settlement replaces the
  reservation by the real usage. Reserved tokens therefore never exceed the budget, under
  any parallelism, with any number of gateways sharing one store.
* **Settlement** happens once per lease: the store remembers settled lease ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvfleet_gateway.config import Limits

WINDOW_S = 60
SETTLED_MEMORY_S = 3600
"""How long a settled lease id is remembered (a duplicate settle can only come within a
request's lifetime plus retries)."""
Reason = Literal["requests", "tokens", "concurrency", "budget", "store_unavailable", "store_reset"]


@dataclass(frozen=True)
class Ticket:
    tenant: str
    limits: Limits
    reserve_tokens: int
    """Estimated prompt tokens + max_tokens."""
    lease_id: str
    now: float
    """Unix time, seconds."""
    lease_ttl_s: float = 60.0
    budget_need: int | None = None
    """What the request may cost against a cost budget, in `COST_UNIT`s (None: its tokens)."""

    @property
    def budget_units(self) -> int:
        return self.reserve_tokens if self.budget_need is None else self.budget_need


COST_UNIT = 1e-6
"""Cost budgets are counted in millionths of the price currency (integers, as tokens are)."""


@dataclass(frozen=True)
class BudgetSpec:
    """A tenant's budget in the store's integer units: tokens, or millionths of the currency."""

    limit: int
    period: float
    unit: Literal["tokens", "cost"]


def budget_spec(lim: Limits) -> BudgetSpec | None:
    if lim.token_budget is not None:
        return BudgetSpec(lim.token_budget.tokens, float(lim.token_budget.period), "tokens")
    if lim.cost_budget is not None:
        limit = max(1, round(lim.cost_budget.amount / COST_UNIT))
        return BudgetSpec(limit, float(lim.cost_budget.period), "cost")
    return None


def cost_units(amount: float) -> int:
    """An amount of money in the store's units, rounded up (a bound must not undercount)."""
    return math.ceil(amount / COST_UNIT - 1e-9)


@dataclass(frozen=True)
class BudgetState:
    """A tenant's token budget in the current period, as the store holds it."""

    limit: int
    spent: int
    """Settled: what finished requests were billed."""
    reserved: int
    """Held by requests in flight: each reserves its upper bound (prompt + max_tokens) until
    it settles to what it used."""
    resets_at: float | None = None
    """Unix time this period ends and the budget starts again (None: not known here)."""
    unit: Literal["tokens", "cost"] = "tokens"
    """Tokens, or millionths of the price currency (a cost budget)."""

    @property
    def left(self) -> int:
        """The budget less what was spent (what is left once every request in flight ends
        having used nothing)."""
        return max(0, self.limit - self.spent)

    @property
    def available(self) -> int:
        """What a new request may reserve now."""
        return max(0, self.limit - self.spent - self.reserved)

    @property
    def in_use(self) -> int:
        return self.spent + self.reserved


def period_end(period: int, period_s: float) -> float:
    """When budget period number `period` ends: periods are aligned to the Unix epoch (the
    period holding `now` is `floor(now / period_s)`)."""
    return (period + 1) * period_s


def _amount(units: int, unit: str) -> str:
    return f"{units * COST_UNIT:,.6f}" if unit == "cost" else f"{units:,}"


def _may_need(need: int, unit: str) -> str:
    if unit == "cost":
        return (
            f"cost budget: this request may cost up to {_amount(need, unit)} (its prompt and"
            " max_tokens at the model's price)"
        )
    return f"token budget: this request may need up to {need:,} tokens (prompt + max_tokens)"


def budget_refusal(need: int, state: BudgetState) -> str:
    """The 429 message of a request the budget cannot take: its bound against what remains."""
    u = state.unit
    return (
        f"{_may_need(need, u)}; "
        f"{_amount(state.available, u)} of {_amount(state.limit, u)} remain this period"
        f" ({_amount(state.spent, u)} spent, {_amount(state.reserved, u)} reserved by requests"
        " in flight)"
    )


BUDGET_SETTLE_RETRY_S = 1.0
"""Retry-After of a budget refusal that only the tenant's requests in flight cause: each
settles to what it used when it ends (most use far less than they reserve)."""


def budget_retry(state: BudgetState, need: int, until_reset: float) -> float:
    """When a request needing `need` could be admitted: once the reservations in flight
    settle, when it fits what was spent; else at the period's reset."""
    if state.reserved and state.spent + need <= state.limit:
        return BUDGET_SETTLE_RETRY_S
    return until_reset


def over_concurrency(limit: int) -> str:
    """The 429 of a tenant with `limit` requests in flight already."""
    return f"{limit} concurrent requests already running"


def budget_too_small(need: int, limit: int, unit: str = "tokens") -> str:
    """The 429 of a request whose bound exceeds the whole budget (waiting cannot help)."""
    return (
        f"{_may_need(need, unit)}, more than the whole budget of {_amount(limit, unit)} per"
        " period: lower max_tokens"
    )


@dataclass(frozen=True)
class Quota:
    """What the `x-ratelimit-*` headers report after a decision."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float = 0.0
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float = 0.0
    budget: BudgetState | None = None

    @property
    def budget_remaining(self) -> int | None:
        """What `x-kvfleet-budget-remaining-tokens` says: the budget less what settled
        requests were billed (requests in flight, this one included, are reported apart:
        `x-kvfleet-budget-reserved-tokens`)."""
        return None if self.budget is None else self.budget.left


@dataclass(frozen=True)
class Lease:
    lease_id: str
    tenant: str
    reserved_tokens: int
    bucket: int
    """The second the tokens-per-minute reservation was recorded in (refunds go there)."""
    budget_period: int | None
    degraded: bool = False
    """Admitted by the local fallback while the shared store was down."""
    budget_period_s: float | None = None
    budget_tokens: int | None = None
    """The tenant's budget per period, to report its state after settling."""
    budget_reserved: int | None = None
    """What it holds of the budget (None: `reserved_tokens`)."""
    budget_unit: Literal["tokens", "cost"] = "tokens"


@dataclass(frozen=True)
class Decision:
    admitted: bool
    quota: Quota
    lease: Lease | None = None
    reason: Reason | None = None
    retry_after_s: float | None = None
    """None with a rejection: waiting will never help (the request is larger than the limit)."""
    message: str = ""


class LimitStore(Protocol):
    async def admit(self, ticket: Ticket) -> Decision: ...

    async def settle(
        self, lease: Lease, used_tokens: int, now: float, budget_used: int | None = None
    ) -> bool:
        """Record real usage and free the lease; True only for the first call per lease."""
        ...

    async def heartbeat(self, lease: Lease, now: float, ttl_s: float) -> None: ...

    async def active_leases(self, tenant: str, now: float) -> int: ...

    async def budget_state(self, tenant: str, budget: BudgetSpec, now: float) -> BudgetState:
        """The tenant's budget in the current period of `budget`."""
        ...

    def budget_seen(self, tenant: str) -> BudgetState | None:
        """The tenant's budget as the last settlement here left it (asks the store nothing)."""
        ...


def reset_after(buckets: dict[int, int], now: float) -> float:
    """Seconds until the oldest counted bucket leaves the window."""
    return max(0.0, min(buckets) + WINDOW_S - now) if buckets else 0.0


def wait_for_room(buckets: dict[int, int], total: int, need: int, limit: int, now: float) -> float:
    """Seconds until enough old buckets expire for `need` more to fit under `limit`."""
    for sec in sorted(buckets):
        total -= buckets[sec]
        if total + need <= limit:
            return max(0.0, sec + WINDOW_S - now)
    return float(WINDOW_S)


@dataclass
class _TenantState:
    leases: dict[str, tuple[float, int]] = field(default_factory=dict)
    reserved: int = 0
    requests: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    budget: dict[int, int] = field(default_factory=dict)
    settled: dict[str, float] = field(default_factory=dict)

    def prune(self, now: float) -> None:
        for lid, (expiry, reserved) in list(self.leases.items()):
            if expiry <= now:
                del self.leases[lid]
                self.reserved -= reserved
        floor = math.floor(now) - WINDOW_S + 1
        for buckets in (self.requests, self.tokens):
            for sec in [s for s in buckets if s < floor]:
                del buckets[sec]
        # Insertion order is settlement order: drop from the old end, O(expired).
        while self.settled:
            oldest = next(iter(self.settled))
            if self.settled[oldest] >= now - SETTLED_MEMORY_S:
                break
            del self.settled[oldest]


class MemoryStore:
    """One gateway replica's truth. Atomic because nothing in admit/settle awaits."""

    def __init__(self) -> None:
        self._tenants: dict[str, _TenantState] = {}
        self._seen: dict[str, BudgetState] = {}

    def _state(self, tenant: str) -> _TenantState:
        return self._tenants.setdefault(tenant, _TenantState())

    async def admit(self, ticket: Ticket) -> Decision:
        return self.admit_now(ticket)

    def admit_now(self, ticket: Ticket, degraded: bool = False) -> Decision:
        st, lim, now = self._state(ticket.tenant), ticket.limits, ticket.now
        need, bneed = ticket.reserve_tokens, ticket.budget_units
        st.prune(now)
        sec = math.floor(now)
        n_req, n_tok = sum(st.requests.values()), sum(st.tokens.values())
        budget = budget_spec(lim)
        period = math.floor(now / budget.period) if budget else None
        used = st.budget.get(period, 0) if period is not None else 0

        def reject(reason: Reason, retry: float | None, message: str) -> Decision:
            return Decision(
                False,
                self._quota(st, lim, now, used),
                reason=reason,
                retry_after_s=retry,
                message=message,
            )

        if lim.max_concurrent is not None and len(st.leases) >= lim.max_concurrent:
            return reject("concurrency", 1.0, over_concurrency(lim.max_concurrent))
        rpm = lim.requests_per_minute
        if rpm is not None and n_req + 1 > rpm:
            return reject(
                "requests",
                wait_for_room(st.requests, n_req, 1, rpm, now),
                f"limit of {rpm} requests per minute reached",
            )
        tpm = lim.tokens_per_minute
        if tpm is not None and need > tpm:
            return reject(
                "tokens",
                None,
                f"request needs {need} tokens, more than the limit "
                f"of {tpm} tokens per minute: lower max_tokens",
            )
        if tpm is not None and n_tok + need > tpm:
            return reject(
                "tokens",
                wait_for_room(st.tokens, n_tok, need, tpm, now),
                f"limit of {tpm} tokens per minute reached",
            )
        if budget is not None and period is not None:
            if bneed > budget.limit:
                return reject("budget", None, budget_too_small(bneed, budget.limit, budget.unit))
            if used + st.reserved + bneed > budget.limit:
                state = BudgetState(budget.limit, used, st.reserved, unit=budget.unit)
                retry = budget_retry(state, bneed, period_end(period, budget.period) - now)
                return reject("budget", retry, budget_refusal(bneed, state))
        st.leases[ticket.lease_id] = (now + ticket.lease_ttl_s, bneed)
        st.reserved += bneed
        st.requests[sec] = st.requests.get(sec, 0) + 1
        st.tokens[sec] = st.tokens.get(sec, 0) + need
        lease = Lease(
            ticket.lease_id,
            ticket.tenant,
            need,
            sec,
            period,
            degraded,
            budget.period if budget else None,
            budget.limit if budget else None,
            bneed,
            budget.unit if budget else "tokens",
        )
        return Decision(True, self._quota(st, lim, now, used), lease=lease)

    @staticmethod
    def _quota(st: _TenantState, lim: Limits, now: float, budget_used: int) -> Quota:
        def left(limit: int | None, used: int) -> int | None:
            return None if limit is None else max(0, limit - used)

        budget = budget_spec(lim)
        return Quota(
            limit_requests=lim.requests_per_minute,
            remaining_requests=left(lim.requests_per_minute, sum(st.requests.values())),
            reset_requests_s=reset_after(st.requests, now),
            limit_tokens=lim.tokens_per_minute,
            remaining_tokens=left(lim.tokens_per_minute, sum(st.tokens.values())),
            reset_tokens_s=reset_after(st.tokens, now),
            budget=None
            if budget is None
            else BudgetState(
                budget.limit,
                budget_used,
                st.reserved,
                period_end(math.floor(now / budget.period), budget.period),
                budget.unit,
            ),
        )

    async def settle(
        self, lease: Lease, used_tokens: int, now: float, budget_used: int | None = None
    ) -> bool:
        return self.settle_now(lease, used_tokens, now, budget_used)

    def settle_now(
        self, lease: Lease, used_tokens: int, now: float, budget_used: int | None = None
    ) -> bool:
        st = self._state(lease.tenant)
        if lease.lease_id in st.settled:
            return False
        st.settled[lease.lease_id] = now
        held = st.leases.pop(lease.lease_id, None)
        if held is not None:
            st.reserved -= held[1]
        if lease.budget_period is not None:
            used = used_tokens if budget_used is None else budget_used
            st.budget[lease.budget_period] = st.budget.get(lease.budget_period, 0) + used
            if lease.budget_tokens is not None:
                spent = st.budget[lease.budget_period]
                self._seen[lease.tenant] = BudgetState(
                    lease.budget_tokens, spent, st.reserved, unit=lease.budget_unit
                )
        if lease.bucket in st.tokens:
            st.tokens[lease.bucket] = max(
                0, st.tokens[lease.bucket] + used_tokens - lease.reserved_tokens
            )
        return True

    async def heartbeat(self, lease: Lease, now: float, ttl_s: float) -> None:
        st = self._state(lease.tenant)
        if lease.lease_id in st.leases:
            st.leases[lease.lease_id] = (now + ttl_s, st.leases[lease.lease_id][1])

    async def active_leases(self, tenant: str, now: float) -> int:
        st = self._state(tenant)
        st.prune(now)
        return len(st.leases)

    def budget_seen(self, tenant: str) -> BudgetState | None:
        return self._seen.get(tenant)

    async def budget_state(self, tenant: str, budget: BudgetSpec, now: float) -> BudgetState:
        st = self._state(tenant)
        st.prune(now)
        spent = st.budget.get(math.floor(now / budget.period), 0)
        return BudgetState(budget.limit, spent, st.reserved, unit=budget.unit)
