"""One conformance suite for both limit stores (memory, real Redis): same answers."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvfleet_gateway.config import Duration, Limits, TokenBudget
from kvfleet_gateway.limiter import BUDGET_SETTLE_RETRY_S, LimitStore, MemoryStore, Ticket
from kvfleet_gateway.redis_store import RedisStore
from tests.support.gateway import budget_in_use


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[LimitStore]:
    if request.param == "memory":
        yield MemoryStore()
        return
    url = request.getfixturevalue("redis_url")
    rs = RedisStore(url)
    async with rs.running():
        yield rs


def ticket(limits: Limits, need: int = 100, tenant: str = "t", ttl: float = 60.0) -> Ticket:
    return Ticket(tenant, limits, need, uuid.uuid4().hex, time.time(), ttl)


async def test_concurrency_slots_are_leases(store: Any) -> None:
    lim = Limits(max_concurrent=2)
    a = await store.admit(ticket(lim))
    b = await store.admit(ticket(lim))
    c = await store.admit(ticket(lim))
    assert a.admitted and b.admitted and not c.admitted
    assert c.reason == "concurrency"
    assert await store.settle(a.lease, 50, time.time())
    assert (await store.admit(ticket(lim))).admitted
    assert await store.active_leases("t", time.time()) == 2


async def test_leases_of_a_crashed_gateway_expire(store: Any) -> None:
    lim = Limits(max_concurrent=1)
    assert (await store.admit(ticket(lim, ttl=0.3))).admitted
    assert not (await store.admit(ticket(lim, ttl=0.3))).admitted
    await asyncio.sleep(0.4)
    assert (await store.admit(ticket(lim))).admitted


async def test_heartbeat_keeps_a_long_request_alive(store: Any) -> None:
    lim = Limits(max_concurrent=1)
    d = await store.admit(ticket(lim, ttl=0.3))
    for _ in range(3):
        await asyncio.sleep(0.15)
        await store.heartbeat(d.lease, time.time(), 0.3)
    assert not (await store.admit(ticket(lim))).admitted


async def test_budget_reserves_then_settles_to_real_usage(store: Any) -> None:
    lim = Limits(token_budget=TokenBudget(tokens=1000, period=Duration(86400)))
    a = await store.admit(ticket(lim, need=600))
    assert a.admitted and a.quota.budget_remaining == 1000  # settled: none yet
    assert a.quota.budget is not None and a.quota.budget.reserved == 600
    refused = await store.admit(ticket(lim, need=600))
    assert not refused.admitted and refused.reason == "budget"
    # It fits once the request in flight settles: retry soon, not at the period's reset.
    assert refused.retry_after_s == BUDGET_SETTLE_RETRY_S
    assert await store.settle(a.lease, 150, time.time())  # used far less than reserved
    assert await budget_in_use(store, "t", lim, time.time()) == 150
    b = await store.admit(ticket(lim, need=600))
    assert b.admitted
    spent = await store.admit(ticket(lim, need=900))  # 150 spent + 900 > 1000: the reset
    assert not spent.admitted and spent.retry_after_s is not None
    assert BUDGET_SETTLE_RETRY_S < spent.retry_after_s <= 86400
    too_big = await store.admit(ticket(lim, need=5000))
    assert not too_big.admitted and too_big.retry_after_s is None


async def test_settlement_happens_once(store: Any) -> None:
    lim = Limits(token_budget=TokenBudget(tokens=1000, period=Duration(86400)))
    d = await store.admit(ticket(lim, need=100))
    assert await store.settle(d.lease, 80, time.time())
    assert not await store.settle(d.lease, 80, time.time())
    assert await budget_in_use(store, "t", lim, time.time()) == 80


async def test_requests_per_minute_and_quota_headers(store: Any) -> None:
    lim = Limits(requests_per_minute=3, tokens_per_minute=1000)
    ds = [await store.admit(ticket(lim, need=100)) for _ in range(4)]
    assert [d.admitted for d in ds] == [True, True, True, False]
    assert ds[0].quota.remaining_requests == 2 and ds[2].quota.remaining_requests == 0
    assert ds[0].quota.remaining_tokens == 900
    assert ds[3].reason == "requests"
    assert ds[3].retry_after_s is not None and 55 <= ds[3].retry_after_s <= 60
    assert 55 <= ds[2].quota.reset_requests_s <= 60


async def test_tokens_per_minute_counts_real_usage_after_settlement(store: Any) -> None:
    lim = Limits(tokens_per_minute=1000)
    a = await store.admit(ticket(lim, need=900))
    assert not (await store.admit(ticket(lim, need=200))).admitted
    await store.settle(a.lease, 100, time.time())  # refund 800 into the same window
    assert (await store.admit(ticket(lim, need=200))).admitted
    huge = await store.admit(ticket(lim, need=5000))
    assert not huge.admitted and huge.retry_after_s is None and "max_tokens" in huge.message


async def test_tenants_are_independent(store: Any) -> None:
    lim = Limits(max_concurrent=1)
    assert (await store.admit(ticket(lim, tenant="a"))).admitted
    assert (await store.admit(ticket(lim, tenant="b"))).admitted


async def test_parallel_admissions_never_overspend(store: Any) -> None:
    lim = Limits(token_budget=TokenBudget(tokens=10_000, period=Duration(86400)))
    decisions = await asyncio.gather(*(store.admit(ticket(lim, need=300)) for _ in range(200)))
    admitted = [d for d in decisions if d.admitted]
    assert len(admitted) == 10_000 // 300  # exactly as many as fit, never one more


def test_sliding_window_does_not_double_at_the_edge() -> None:
    """Fixed windows admit 2× the limit around a boundary; the sliding window does not."""
    store = MemoryStore()
    lim = Limits(requests_per_minute=10)
    t0 = 1_000_000.0 + 59.5  # half a second before a minute boundary
    first = [store.admit_now(Ticket("t", lim, 1, f"a{i}", t0)).admitted for i in range(10)]
    after = [store.admit_now(Ticket("t", lim, 1, f"b{i}", t0 + 1.0)).admitted for i in range(10)]
    assert all(first) and not any(after)
    later = store.admit_now(Ticket("t", lim, 1, "c", t0 + 60.0))
    assert later.admitted
