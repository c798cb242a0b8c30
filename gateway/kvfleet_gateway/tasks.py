"""Background work owned by a cleanup context: started on entry, cancelled on exit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

log = logging.getLogger("kvfleet.gateway")


@contextlib.asynccontextmanager
async def every(
    interval_s: float, work: Callable[[], Awaitable[object]], name: str
) -> AsyncIterator[None]:
    """Run `work` every `interval_s` seconds (after the first wait) while the block runs.

    A round that raises is logged and the next round runs as planned: one bad probe or
    unreadable file must not silently stop health checks or key reloads for good.
    """

    async def loop() -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await work()
            except Exception:
                log.exception("background task %s failed; retrying in %.1fs", name, interval_s)

    task = asyncio.create_task(loop(), name=name)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
