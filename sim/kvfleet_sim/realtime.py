"""Drive an engine in real time with asyncio: sleep each step's duration, then close it.

Handlers wait on a per-request `Channel`; the runner wakes every channel whose request got
a token, finished or was aborted after each step. A `time_scale` on the clock stretches or
compresses simulated GPU time into wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from kvfleet_sim.engine import Engine, RealClock
from kvfleet_sim.request import Request


class Channel:
    """Wakes one handler when its request changes."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event.clear()


def _notify(req: Request) -> None:
    if isinstance(req.tag, Channel):
        req.tag.notify()


class RealtimeRunner:
    def __init__(self, engine: Engine, clock: RealClock) -> None:
        self.engine = engine
        self.clock = clock
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        engine.aborted_listeners.append(_notify)

    def submit(self, req: Request) -> Channel:
        channel = Channel()
        req.tag = channel
        self.engine.submit(req)
        self._wake.set()
        return channel

    def abort(self, req: Request) -> None:
        self.engine.abort(req)
        self._wake.set()

    async def _loop(self) -> None:
        engine = self.engine
        while True:
            step = engine.begin_step()
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(self.clock.wall_seconds(step.duration))
            outcome = engine.end_step(step)
            for req in outcome.emitted:
                _notify(req)
            for req in outcome.batch.reqs:
                if req.aborted:
                    _notify(req)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RealtimeRunner]:
        self._task = asyncio.create_task(self._loop(), name="sim-engine-loop")
        try:
            yield self
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
