"""A trickle buys no GPUs: on the local cluster, the real operator keeps an autoscaled
service at its minimum under three small requests (the first-hour user's curls), and still
scales it up under a sustained load past what one replica has shown it serves — so the fix
is not "never scale"."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvfleet_operator.kube import DEPLOYMENT
from kvfleet_operator.scaling.autoscaler import AutoscalerConfig
from tests.integration.test_autoscaling import Stack, burst, stack
from tests.support.cluster import OperatorThread
from tests.support.objects import NS, isvc
from tests.support.waiting import until

__all__ = ["stack"]  # the fixture, shared with test_autoscaling

# The example's shape (examples/llama-3.1-8b-h100-autoscaling.yaml): a minimum of two, a
# cold start of minutes (the forecast's horizon), an SLO; windows short for a test's clock.
TRICKLE = {
    "minReplicas": 2,
    "maxReplicas": 4,
    "targetQueueDepth": 2,
    "scaleUpStabilizationSeconds": 0,
    "scaleDownStabilizationSeconds": 30,
    "coldStartSeconds": 240,
    "slo": {"ttftSeconds": 2},
}


# Ticks of 5 s: the three requests land in one tick, as three curls land in one of the
# default 15 s (a 1 s tick would see them as separate blips, each too brief to forecast on).
TICK_S = 5.0


def start_operator(stack: Stack) -> None:
    stack.operator = OperatorThread(
        stack.env.credentials, autoscaler=AutoscalerConfig(interval_s=TICK_S, stale_s=3 * TICK_S)
    )
    assert stack.operator.ready.wait(15), "the operator did not start"


def decision(stack: Stack) -> dict[str, Any]:
    return (stack.body().get("status") or {}).get("autoscaling") or {}


def engine_replicas(stack: Stack) -> int:
    return int((stack.env.kube.get(DEPLOYMENT, NS, "llama-engine") or {})["spec"]["replicas"])


async def test_three_small_requests_leave_the_minimum_and_sustained_load_scales(
    stack: Stack,
) -> None:
    # Two running requests per replica: a sustained load of long answers queues at once.
    service = isvc(
        "llama",
        engine={"gpuType": "h100", "maxRunningRequests": 2, "contextLength": 32768},
        autoscaling=TRICKLE,
    )
    await asyncio.to_thread(start_operator, stack)
    await asyncio.to_thread(stack.env.kube.create, service)
    await until(lambda: list(stack.roles().values()) == ["active"] * 2, 30, "two active")
    url = str(await until(stack.gateway_url, 30, "a ready gateway pod"))
    await until(lambda: decision(stack), 15, "a decision")
    # Three 20-token requests, one after the other (curl, curl, curl), then six ticks of
    # every decision watched: none may ask for more than the minimum.
    for _ in range(3):
        assert await burst(url, 1, 20) == [200]
    seen: list[dict[str, Any]] = []
    end = time.monotonic() + 6 * TICK_S
    while time.monotonic() < end:
        seen.append(await asyncio.to_thread(decision, stack))
        await asyncio.sleep(0.25)
    wanted = {d.get("desiredActive") for d in seen} | {d.get("desiredWarm", 0) + 2 for d in seen}
    assert wanted == {2}, [d.get("reason") for d in seen if d.get("desiredActive") != 2][:3]
    assert await asyncio.to_thread(engine_replicas, stack) == 2
    # A sustained load: ~3 requests/s of 300 tokens for 24 s; one replica at two slots
    # serves under one a second, so the queue grows and the fleet must grow with it.
    load = asyncio.create_task(burst(url, 80, 300, every_s=0.3))
    try:
        up = await until(
            lambda: (d := decision(stack)).get("desiredActive", 0) > 2 and d,
            8 * TICK_S,
            "a scale-up under sustained load",
        )
    finally:
        statuses = await load
    assert statuses == [200] * 80
    assert up["boundBy"] in ("queue", "slots", "kv", "slo", "forecast", "max"), up
    print("scaled up:", up["reason"])
    await until(lambda: engine_replicas(stack) > 2, 15, "the engine Deployment grown")
