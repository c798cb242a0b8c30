"""The inter-token latency objective on the local cluster: the real operator scales a service
whose streams are slower than `slo.itlSeconds`. Its margins are wide (a decode step of
several milliseconds against 2 ms and 1 s objectives), so it runs beside other tests."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvfleet_operator.kube import ISVC
from tests.integration.test_autoscaling import AUTOSCALING, Stack, burst, stack
from tests.support.objects import NS, isvc
from tests.support.waiting import until

__all__ = ["stack"]  # the fixture, shared with test_autoscaling


async def test_an_inter_token_latency_objective_adds_a_replica(stack: Stack) -> None:
    """Streams whose chunks come slower than `slo.itlSeconds` add a replica, with KV and
    queue quiet (no slot limit, few requests): the gateway's inter-token latency histogram,
    scraped and differenced per tick, is the signal. The same traffic under an objective it
    meets changes nothing, so the check can fail."""
    lenient = {**AUTOSCALING, "warmReplicas": 0, "slo": {"itlSeconds": 1.0}}
    service = isvc("llama", engine={"gpuType": "h100"}, autoscaling=lenient)
    await asyncio.to_thread(stack.start_operator)
    await asyncio.to_thread(stack.env.kube.create, service)
    await until(lambda: list(stack.roles().values()) == ["active"], 30, "one active replica")
    url = str(await until(stack.gateway_url, 30, "a ready gateway pod"))

    async def streams_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # three 64-token streams at a time (~7 ms a step)
            assert await burst(url, 3, 64, ignore_eos=True) == [200] * 3

    def auto() -> dict[str, Any]:
        return (stack.body().get("status") or {}).get("autoscaling") or {}

    # Five ticks of 1 s, each with streams scraped on both sides; every decision is read
    # (the forecast may add a replica for the rising rate: that is not this term).
    bound_by: set[str] = set()
    load = asyncio.create_task(streams_for(5.0))
    while not load.done():
        said = await asyncio.to_thread(auto)  # (the API server runs on this loop)
        bound_by.add(said.get("boundBy", ""))
        await asyncio.sleep(0.2)
    await load
    assert "itl" not in bound_by, bound_by
    strict = {"spec": {"autoscaling": {"slo": {"itlSeconds": 0.002}}}}  # under a decode step
    await asyncio.to_thread(stack.env.kube.patch, ISVC, NS, "llama", strict)
    load = asyncio.create_task(streams_for(20.0))

    def bound_by_itl() -> dict[str, Any] | None:
        said = auto()  # the decision itself: the next tick may already have replaced it
        return said if said.get("boundBy") == "itl" else None

    try:
        said = await until(bound_by_itl, 20, "a decision bound by the ITL")
    finally:
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
    assert said["desiredActive"] >= 2, said
    assert "inter-token latency" in said["reason"] and "over the SLO 2ms" in said["reason"]
