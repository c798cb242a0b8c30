"""The shared store: the limiter's algorithm run in Redis (one truth for N gateways), through
the scripts of `redis_scripts`, with what a gateway does when Redis is away.

Outage policy (documented in the README): while Redis is unreachable
* tenants with a token budget are refused with 503 (budgets fail closed: no overspend);
* rate and concurrency limits degrade to a local share, 1/`gateway_replicas` of each limit
  per gateway (never unlimited), through an in-memory store;
* settlements that could not be written are retried in the background until Redis answers;
  at shutdown they are retried for `limits.settleGrace`, then kept in `limits.journal` (when
  configured) and replayed by the next start, or reported lost in the log.

Data loss: a Redis that restarts *empty* (no AOF/RDB) would silently reset every spent
budget. Each tenant's budget keys therefore carry a generation (`kvf:{tenant}:gen`, created
with the tenant's first budgeted request). A gateway remembers the generation it saw; when the
key is gone it writes a tombstone (`lost:<generation>`) and from then on every gateway, old or
newly started, refuses that tenant's budgeted requests (503 `limits_unavailable`) until an
administrator restores Redis's data or accepts the loss with `kvfleet budgets reset`. A gateway
that has never seen the tenant cannot tell a first request from a loss; the tombstone is what
carries the knowledge to it. Run Redis with `appendonly yes` so a restart keeps the data.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvfleet_gateway.config import Limits
from kvfleet_gateway.limiter import (
    SETTLED_MEMORY_S,
    WINDOW_S,
    BudgetSpec,
    BudgetState,
    Decision,
    Lease,
    MemoryStore,
    Quota,
    Reason,
    Ticket,
    budget_refusal,
    budget_spec,
    budget_too_small,
    over_concurrency,
    period_end,
)
from kvfleet_gateway.redis_scripts import (
    ADMIT,
    HEARTBEAT,
    LOST,
    SETTLE,
    STORE_RESET_MESSAGE,
    budget_tag,
    tenant_keys,
)
from kvfleet_gateway.tasks import every

log = logging.getLogger("kvfleet.gateway.redis")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _num(value: Any) -> float | None:
    text = _text(value)
    return float(text) if text else None


def local_share(limits: Limits, replicas: int) -> Limits:
    """Each of N gateways enforces 1/N of every rate limit on its own (at least 1)."""

    def share(v: int | None) -> int | None:
        return None if v is None else max(1, math.floor(v / replicas))

    return replace(
        limits,
        requests_per_minute=share(limits.requests_per_minute),
        tokens_per_minute=share(limits.tokens_per_minute),
        max_concurrent=share(limits.max_concurrent),
    )


class RedisStore:
    def __init__(
        self,
        url: str,
        gateway_replicas: int = 1,
        retry_after_s: float = 1.0,
        settle_grace_s: float = 10.0,
        journal: Path | None = None,
        scope: str = "",
        password: str | None = None,
    ) -> None:
        self.url = url
        self.scope = scope
        """Whose tenants these are (`limits.scope`): keys of other scopes are never touched."""
        self.replicas = gateway_replicas
        self.retry_after_s = retry_after_s
        self.settle_grace_s = settle_grace_s
        self.journal = journal
        self.client = connect(url, password)
        self._admit = self.client.register_script(ADMIT)
        self._settle = self.client.register_script(SETTLE)
        self._seen: dict[str, BudgetState] = {}
        """Each tenant's budget as the last settlement written here left it."""
        self._heartbeat = self.client.register_script(HEARTBEAT)
        self.fallback = MemoryStore()
        self._down_until = 0.0
        self.pending: list[tuple[Lease, int, int | None]] = []
        """Settlements Redis has not taken yet: lease, tokens used, budget units used."""
        """Settlements admitted by Redis but not yet written back to it."""
        self.generations: dict[str, str] = {}
        """The budget-store generation last seen per tenant (see the module's docstring)."""
        self.lost: set[str] = set()
        """Tenants whose budget data this gateway found lost (logged once)."""

    @property
    def degraded(self) -> bool:
        return time.monotonic() < self._down_until

    def _keys_of(self, tenant: str) -> dict[str, str]:
        """`tenant`'s keys in this store's scope."""
        return tenant_keys(budget_tag(self.scope, tenant))

    async def reachable(self) -> bool:
        """Redis answers a PING now (what readiness asks); a failure counts as an outage."""
        if self.degraded:
            return False
        try:
            await self.client.ping()
        except RedisError as exc:
            self._mark_down(exc)
            return False
        return True

    def _mark_down(self, exc: Exception) -> None:
        if not self.degraded:
            log.error(
                "redis unavailable (%s): budgets fail closed, rates use a local 1/%d share",
                exc.__class__.__name__,
                self.replicas,
            )
        self._down_until = time.monotonic() + self.retry_after_s

    async def admit(self, ticket: Ticket) -> Decision:
        lim = ticket.limits
        if not self.degraded:
            budget = budget_spec(lim)
            k = self._keys_of(ticket.tenant)
            argv: list[str | int | float] = [
                ticket.lease_id,
                ticket.reserve_tokens,
                ticket.lease_ttl_s,
                -1 if lim.requests_per_minute is None else lim.requests_per_minute,
                -1 if lim.tokens_per_minute is None else lim.tokens_per_minute,
                -1 if lim.max_concurrent is None else lim.max_concurrent,
                -1 if budget is None else budget.limit,
                1 if budget is None else budget.period,
                self.generations.get(ticket.tenant, ""),
                uuid.uuid4().hex,
                ticket.budget_units,
            ]
            try:
                res = await self._admit(keys=list(k.values()), args=argv)
            except RedisError as exc:
                if not pool_busy(exc):  # a local wait for a pooled connection is no outage
                    self._mark_down(exc)
            else:
                return self._decision(ticket, res)
        if budget_spec(lim) is not None:
            return Decision(
                False,
                Quota(),
                reason="store_unavailable",
                retry_after_s=1.0,
                message="the budget store is unavailable; budgets fail closed",
            )
        local = replace(ticket, limits=local_share(lim, self.replicas))
        return self.fallback.admit_now(local, degraded=True)

    def _decision(self, ticket: Ticket, res: list[Any]) -> Decision:
        ok, reason, retry, nreq, ntok, reserved, used, rreq, rtok, period, sec, gen = res
        lim = ticket.limits
        gen = _text(gen)
        if gen:
            self.generations[ticket.tenant] = gen
            if ticket.tenant in self.lost:
                self.lost.discard(ticket.tenant)
                log.warning("tenant %s: the budget store serves budgets again", ticket.tenant)

        def left(limit: int | None, n: int) -> int | None:
            return None if limit is None else max(0, limit - n)

        budget = budget_spec(lim)
        quota = Quota(
            lim.requests_per_minute,
            left(lim.requests_per_minute, nreq),
            _num(rreq) or 0.0,
            lim.tokens_per_minute,
            left(lim.tokens_per_minute, ntok),
            _num(rtok) or 0.0,
            None
            if budget is None
            else BudgetState(
                budget.limit,
                int(used),
                int(reserved),
                period_end(int(period), budget.period),
                budget.unit,
            ),
        )
        if ok:
            lease = Lease(
                ticket.lease_id,
                ticket.tenant,
                ticket.reserve_tokens,
                int(sec),
                None if period < 0 else int(period),
                budget_period_s=budget.period if budget else None,
                budget_tokens=budget.limit if budget else None,
                budget_reserved=ticket.budget_units,
                budget_unit=budget.unit if budget else "tokens",
            )
            return Decision(True, quota, lease=lease)
        why = reason.decode() if isinstance(reason, bytes) else str(reason)
        messages = {
            "concurrency": over_concurrency(lim.max_concurrent or 0),
            "requests": f"limit of {lim.requests_per_minute} requests per minute reached",
            "tokens": f"limit of {lim.tokens_per_minute} tokens per minute reached",
            "budget": budget_refusal(
                ticket.budget_units,
                BudgetState(
                    budget.limit if budget else 0,
                    int(used),
                    int(reserved),
                    unit=budget.unit if budget else "tokens",
                ),
            ),
            "store_reset": STORE_RESET_MESSAGE,
        }
        wait = _num(retry)
        if why == "store_reset":
            if ticket.tenant not in self.lost:  # once per tenant, not once per request
                self.lost.add(ticket.tenant)
                log.error("tenant %s: %s", ticket.tenant, STORE_RESET_MESSAGE)
            wait = self.retry_after_s
        elif wait is None:
            messages["tokens"] = (
                f"request needs {ticket.reserve_tokens} tokens, more than the "
                f"limit of {lim.tokens_per_minute} per minute: lower max_tokens"
            )
            messages["budget"] = budget_too_small(
                ticket.budget_units,
                budget.limit if budget else 0,
                budget.unit if budget else "tokens",
            )
        return Decision(
            False,
            quota,
            reason=cast(Reason, why),
            retry_after_s=wait,
            message=messages.get(why, why),
        )

    async def settle(
        self, lease: Lease, used_tokens: int, now: float, budget_used: int | None = None
    ) -> bool:
        if lease.degraded:
            return self.fallback.settle_now(lease, used_tokens, now, budget_used)
        try:
            return await self._write_settlement(lease, used_tokens, budget_used)
        except RedisError as exc:
            if not pool_busy(exc):
                self._mark_down(exc)
            self.pending.append((lease, used_tokens, budget_used))
            return True  # settled locally; written to Redis by the retry loop

    async def _write_settlement(self, lease: Lease, used: int, budget_used: int | None) -> bool:
        k = self._keys_of(lease.tenant)
        keys = [
            k["leases"],
            k["resv"],
            k["rtot"],
            k["tq"],
            k["budget"],
            f"kvf:{{{budget_tag(self.scope, lease.tenant)}}}:settled:{lease.lease_id}",
        ]
        period = -1 if lease.budget_period is None else lease.budget_period
        # The budget hash outlives its period (two periods, at least a day).
        budget_ttl = max(86400, int(2 * (lease.budget_period_s or 0)))
        res = await self._settle(
            keys=keys,
            args=[
                lease.lease_id,
                used,
                lease.reserved_tokens,
                lease.bucket,
                period,
                SETTLED_MEMORY_S,
                budget_ttl,
                used if budget_used is None else budget_used,
            ],
        )
        if not res:
            return False  # settled before
        if lease.budget_tokens is not None and isinstance(res, list):
            self._seen[lease.tenant] = BudgetState(
                lease.budget_tokens, int(res[1]), int(res[2]), unit=lease.budget_unit
            )
        return True

    def budget_seen(self, tenant: str) -> BudgetState | None:
        return self._seen.get(tenant) or self.fallback.budget_seen(tenant)

    async def flush_pending(self) -> int:
        written = 0
        while self.pending:
            lease, used, budget_used = self.pending[0]
            await self._write_settlement(lease, used, budget_used)
            self.pending.pop(0)
            written += 1
        return written

    async def heartbeat(self, lease: Lease, now: float, ttl_s: float) -> None:
        if lease.degraded:
            await self.fallback.heartbeat(lease, now, ttl_s)
            return
        with contextlib.suppress(RedisError):
            await self._heartbeat(
                keys=[self._keys_of(lease.tenant)["leases"]],
                args=[lease.lease_id, ttl_s],
            )

    async def active_leases(self, tenant: str, now: float) -> int:
        t = await self.client.time()
        server_now = t[0] + t[1] / 1e6
        return int(
            await self.client.zcount(self._keys_of(tenant)["leases"], f"({server_now}", "+inf")
        )

    async def budget_state(self, tenant: str, budget: BudgetSpec, now: float) -> BudgetState:
        k = self._keys_of(tenant)
        period = math.floor(now / budget.period)
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hget(k["budget"], str(period))
            pipe.get(k["rtot"])
            spent, reserved = await pipe.execute()
        return BudgetState(budget.limit, int(spent or 0), int(reserved or 0), unit=budget.unit)

    async def _retry_pending(self) -> None:
        if self.pending:
            with contextlib.suppress(RedisError):
                n = await self.flush_pending()
                log.info("wrote %d delayed settlements to redis", n)

    def _replay_journal(self) -> None:
        if self.journal is None or not self.journal.exists():
            return
        lines = self.journal.read_text().splitlines()
        for line in lines:
            try:
                entry = json.loads(line)
                b = entry.get("budgetUsed")
                lease, used = Lease(**entry["lease"]), int(entry["used"])
                self.pending.append((lease, used, None if b is None else int(b)))
            except (ValueError, TypeError, KeyError):
                log.error("skipping an unreadable line of the settlement journal %s", self.journal)
        self.journal.unlink()
        if lines:
            log.info("replaying %d settlements from %s", len(self.pending), self.journal)

    async def _drain_pending(self) -> None:
        """At shutdown: keep trying for the grace period, then journal (or report) the rest."""
        deadline = time.monotonic() + self.settle_grace_s
        while self.pending and time.monotonic() < deadline:
            try:
                await self.flush_pending()
            except RedisError:
                await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        if not self.pending:
            return
        tokens = sum(used for _, used, _ in self.pending)
        if self.journal is not None:
            with self.journal.open("a") as f:
                for lease, used, budget_used in self.pending:
                    entry = {"lease": dataclasses.asdict(lease), "used": used}
                    if budget_used is not None:
                        entry["budgetUsed"] = budget_used
                    f.write(json.dumps(entry) + "\n")
            log.warning(
                "redis unreachable at shutdown: %d settlements (%d tokens) kept in %s for the"
                " next start",
                len(self.pending),
                tokens,
                self.journal,
            )
        else:
            log.error(
                "redis unreachable at shutdown: %d settlements (%d tokens) are lost (configure"
                " limits.journal to keep them)",
                len(self.pending),
                tokens,
            )
        self.pending.clear()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RedisStore]:
        self._replay_journal()
        try:
            async with every(self.retry_after_s, self._retry_pending, "redis-settlement-retry"):
                yield self
        finally:
            await self._drain_pending()
            await self.client.aclose()


def pool_busy(exc: Exception) -> bool:
    """No pooled connection came free in time: this gateway is busy, Redis may be fine."""
    return isinstance(exc, RedisConnectionError) and "No connection available" in str(exc)


def connect(url: str, password: str | None = None) -> aioredis.Redis:
    """A client whose commands retry on a fresh connection: after a Redis restart every
    pooled connection is dead, and each must be replaced, not reported as an outage.
    `password`: Redis AUTH, kept out of the URL (which config files and logs show)."""
    extra = {"password": password} if password is not None else {}
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        **extra,
        max_connections=64,
        # A command that waits longer for a pooled connection fails closed (503) but does not
        # mark the store down: this gateway is busy, Redis may be fine (pool_busy).
        timeout=2.0,
        socket_timeout=0.5,
        socket_connect_timeout=0.5,
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=2),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=5,
    )
    return aioredis.Redis(connection_pool=pool)


async def reset_lost_budgets(
    url: str, tenant: str | None = None, scope: str = "", password: str | None = None
) -> list[str]:
    """Accept a data loss: give each tombstoned tenant (or `tenant`) of `scope` a new
    generation, so gateways serve its budget again, counted from zero. Returns the tenants
    reset, as `<scope>/<tenant>` for a scoped one."""
    client = connect(url, password)
    reset: list[str] = []
    try:
        pattern = f"kvf:{{{budget_tag(scope, tenant or '*')}}}:gen"
        async for key in client.scan_iter(match=pattern):
            value = await client.get(key)
            if value is not None and _text(value).startswith(LOST):
                await client.set(key, uuid.uuid4().hex)
                name = _text(key)
                reset.append(name[name.index("{") + 1 : name.rindex("}")])
    finally:
        await client.aclose()
    return sorted(reset)


assert WINDOW_S == 60  # the Lua scripts hard-code the 60-second window
