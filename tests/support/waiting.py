"""One way to wait for a condition, in async tests and in plain ones."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

import pytest


async def until(
    check: Callable[[], Any], limit_s: float = 15.0, what: str = "", interval: float = 0.05
) -> Any:
    """Poll `check` (sync: in a thread, so a server in this loop keeps serving; or async)
    until it returns something truthy, and return that; fail the test after `timeout`."""
    deadline = time.monotonic() + limit_s
    while True:
        try:  # a check that never returns fails the test as one that never holds
            async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                value = await _evaluate(check)
        except TimeoutError:
            pytest.fail(f"timed out after {limit_s:.0f}s in a check of {what or check}")
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {limit_s:.0f}s waiting for {what or check}")
        await asyncio.sleep(interval)


async def _evaluate(check: Callable[[], Any]) -> Any:
    value = check() if inspect.iscoroutinefunction(check) else await asyncio.to_thread(check)
    if inspect.isawaitable(value):
        value = await value
    return value


def until_sync(
    check: Callable[[], Any], limit_s: float = 15.0, what: str = "", interval: float = 0.05
) -> Any:
    """`until` for tests without an event loop."""
    return asyncio.run(until(check, limit_s, what, interval))
