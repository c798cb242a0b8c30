"""The operator's work queue in virtual time (looptime): deduplication, retry backoff that
doubles up to its cap, and periodic resync — minutes of schedule checked in milliseconds."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from kvfleet_operator.handlers import Controller, OperatorConfig
from kvfleet_operator.reconcile import Outcome


class Script:
    """A fake reconcile that fails the first `failures` calls and records when each ran."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.calls: list[tuple[float, str]] = []

    async def __call__(self, namespace: str, name: str) -> Outcome:
        self.calls.append((asyncio.get_running_loop().time(), f"{namespace}/{name}"))
        if len(self.calls) <= self.failures:
            raise RuntimeError("API server said no")
        return Outcome()


def controller(script: Script, **config: Any) -> Controller:
    return Controller(kube=None, config=OperatorConfig(**config), reconciler=script)  # type: ignore[arg-type]


async def run_for(ctl: Controller, seconds: float, resync: bool = False) -> None:
    tasks = [asyncio.create_task(ctl.work())]
    if resync:
        tasks.append(asyncio.create_task(ctl.resync()))
    await asyncio.sleep(seconds)
    for t in tasks:
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t


@pytest.mark.looptime
async def test_failures_back_off_doubling_to_the_cap() -> None:
    script = Script(failures=8)
    ctl = controller(script, max_backoff_s=10.0)
    start = asyncio.get_running_loop().time()
    ctl.enqueue("ai", "llama")
    await run_for(ctl, 60)
    gaps = [round(b[0] - a[0], 3) for a, b in zip(script.calls, script.calls[1:], strict=False)]
    assert gaps[:5] == [1.0, 2.0, 4.0, 8.0, 10.0]  # 0.5 × 2^n, capped
    assert all(g == 10.0 for g in gaps[4:8])
    assert len(script.calls) == 9 and script.calls[0][0] == start  # then it succeeded


@pytest.mark.looptime
async def test_a_key_queued_twice_while_waiting_runs_once() -> None:
    script = Script()
    ctl = controller(script)
    for _ in range(5):
        ctl.enqueue("ai", "llama")
    ctl.enqueue("ai", "qwen")
    await run_for(ctl, 1)
    assert [c[1] for c in script.calls] == ["ai/llama", "ai/qwen"]


@pytest.mark.looptime
async def test_resync_reconciles_every_known_service_each_period() -> None:
    script = Script()
    ctl = controller(script, resync_s=60.0)
    ctl.known |= {("ai", "a"), ("ai", "b")}
    await run_for(ctl, 60 * 10 + 1, resync=True)
    times = sorted({round(t) for t, _ in script.calls})
    assert times == [60 * k for k in range(1, 11)]
    assert len(script.calls) == 20
