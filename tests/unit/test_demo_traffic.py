"""The demo's arrivals in virtual time (looptime): a Poisson process that follows its rate
through a rise, so the trial tenant's burst comes whatever its first gap was."""

from __future__ import annotations

import asyncio
import random
import statistics
from typing import Any

import pytest

from kvfleet_bench.demo.traffic import drive

STEP_AT_S, UNTIL_S = 6.0, 16.5


def step_rate(t: float) -> float:
    """0.2 requests/s, then 1.5 from `STEP_AT_S` (a quick demo's steady phase and burst)."""
    return 0.2 if t < STEP_AT_S else 1.5


async def arrivals(seed: int) -> list[float]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    sent: list[float] = []
    inflight: set[asyncio.Task[Any]] = set()

    async def send() -> None:
        sent.append(loop.time() - start)

    def elapsed() -> float:
        return loop.time() - start

    await drive(step_rate, 1.5, send, elapsed, UNTIL_S, random.Random(seed), inflight)
    await asyncio.sleep(0)  # the last send task runs
    return sent


@pytest.mark.looptime
async def test_arrivals_follow_a_rising_rate() -> None:
    runs = [await arrivals(seed) for seed in range(200)]
    before = [sum(1 for t in r if t < STEP_AT_S) for r in runs]
    after = [sum(1 for t in r if t >= STEP_AT_S) for r in runs]
    # Expected: 0.2 × 6 = 1.2 before the step, 1.5 × 10.5 = 15.75 after; the bounds are four
    # standard errors of a Poisson count's mean over 200 runs (the seeds are fixed, so the
    # result is too: measured 1.08 and 15.82). Drawing each gap at the rate of the moment it
    # was drawn gave 9.8 after the step on the same seeds: a long gap drawn at 0.2/s slept
    # through the start of the burst.
    assert statistics.mean(before) == pytest.approx(1.2, abs=4 * (1.2 / 200) ** 0.5)
    assert statistics.mean(after) == pytest.approx(15.75, abs=4 * (15.75 / 200) ** 0.5)
    assert all(0 <= t < UNTIL_S for r in runs for t in r)


@pytest.mark.looptime
async def test_the_same_seed_sends_the_same_arrivals() -> None:
    first, again = await arrivals(7), await arrivals(7)
    assert [round(t, 6) for t in first] == [round(t, 6) for t in again]


def test_the_demo_says_why_the_warm_spare_is_missing_at_max_replicas() -> None:
    """The demo's service is 1..3 replicas with one warm spare, all inside maxReplicas: at
    3 active there is no spare, and its live view says so (it printed `3/0`)."""
    from kvfleet_bench.demo.cluster_view import desired_text

    def isvc(active: int, warm: int) -> dict[str, object]:
        bounds = {"maxReplicas": 3, "warmReplicas": 1}
        decided = {"desiredActive": active, "desiredWarm": warm}
        return {"spec": {"autoscaling": bounds}, "status": {"autoscaling": decided}}

    assert desired_text(isvc(3, 0)) == "3/0 (no spare: at maxReplicas)"
    assert desired_text(isvc(2, 1)) == "2/1"
    assert desired_text({}) == "-/-"
