"""A request held for a replica (scale from zero, replicas starting) by a pool that is then
replaced — its price changed, its engines' key rotated — is never left waiting on a pool
that has stopped discovering replicas: the old pool waits for what it holds before it
stops, and what it still holds after that is refused with a 503 to retry."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from kvfleet_gateway.backends import Backend, BackendPool
from kvfleet_gateway.config import Hold, Timeouts
from kvfleet_gateway.errors import GatewayError
from kvfleet_gateway.metrics import GatewayMetrics
from kvfleet_gateway.proxy import Proxy
from kvfleet_kernel.schema import Duration


def holding_proxy() -> Proxy:
    return Proxy(
        cast(Any, None),  # no engine is called: the request waits for one
        BackendPool([]),
        cast(Any, None),
        Timeouts(),
        GatewayMetrics(),
        Hold(timeout=Duration(300)),
    )


async def test_a_held_request_is_refused_once_its_pool_retires() -> None:
    proxy = holding_proxy()
    waiting = asyncio.create_task(proxy.wait_for_capacity("llama"))
    await asyncio.sleep(0.3)
    assert proxy.held == 1 and not waiting.done()
    proxy.retired = True
    with pytest.raises(GatewayError) as refused:
        await asyncio.wait_for(waiting, 2)
    assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "1"
    assert proxy.held == 0


async def test_a_held_request_is_served_when_a_replica_appears() -> None:
    proxy = holding_proxy()
    waiting = asyncio.create_task(proxy.wait_for_capacity("llama"))
    await asyncio.sleep(0.3)
    backend = Backend("http://engine:30000")
    backend.healthy, backend.models = True, {"llama": None}
    proxy.pool.backends[backend.url] = backend
    assert [b.url for b in await asyncio.wait_for(waiting, 2)] == [backend.url]
