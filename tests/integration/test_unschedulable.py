"""The real scheduler decides where engines run: an InferenceService asking for more GPUs
than its nodes have gets a Pending engine pod with the scheduler's own `FailedScheduling`
Event, and the service's conditions name the shortage in the scheduler's words."""

from __future__ import annotations

import asyncio
from typing import Any

from kvfleet_operator.kube import EVENT, ISVC, POD
from tests.support.cluster import Env, OperatorFactory
from tests.support.objects import condition, isvc
from tests.support.waiting import until

SHORTAGE = "Insufficient nvidia.com/gpu"


def unschedulable(env: Env, name: str) -> dict[str, Any] | None:
    """The service's body once its Degraded condition says Unschedulable."""
    body = env.kube.get(ISVC, env.ns, name) or {}
    degraded = condition(body, "Degraded")
    ok = (degraded.get("status"), degraded.get("reason")) == ("True", "Unschedulable")
    return body if ok else None


async def test_a_replica_no_node_has_the_gpus_for_stays_pending_and_the_status_says_why(
    local_cluster: Env, operator_factory: OperatorFactory
) -> None:
    """The local cluster has one A100 node of 8 GPUs: two replicas of 8 A100s each. The
    scheduler binds one and leaves the other Pending with its FailedScheduling Event; the
    service serves on the first and is Degraded=True, Unschedulable, the message counting the
    pod and quoting the scheduler (the service said Degraded=False, AsExpected)."""
    env = local_cluster
    await operator_factory()
    spec = isvc("big", env.ns, replicas=2, engine={"gpuType": "a100-80g", "tensorParallel": 8})
    await asyncio.to_thread(env.kube.create, spec)
    body = await until(lambda: unschedulable(env, "big"), 60, "Degraded=True, Unschedulable")
    said = condition(body, "Degraded")["message"]
    assert said.startswith("1 engine pod cannot be scheduled (big-"), said
    assert SHORTAGE in said, said
    pods = await asyncio.to_thread(env.kube.list, POD, env.ns, "app.kubernetes.io/component=engine")
    pending = [p for p in pods if not p["spec"].get("nodeName")]
    placed = [p for p in pods if p["spec"].get("nodeName")]
    assert len(pending) == 1 and [p["spec"]["nodeName"] for p in placed] == ["a100-1"], pods
    assert pending[0]["status"]["phase"] == "Pending"
    assert pending[0]["metadata"]["name"] in said
    name = pending[0]["metadata"]["name"]

    def failed_scheduling() -> list[dict[str, Any]]:
        events = env.kube.list(EVENT, env.ns, fields=f"involvedObject.name={name}")
        return [e for e in events if e.get("reason") == "FailedScheduling"]

    event = (await until(failed_scheduling, 30, "the scheduler's FailedScheduling Event"))[0]
    assert SHORTAGE in event["message"], event
    by = event.get("reportingComponent") or (event.get("source") or {}).get("component")
    assert by == "default-scheduler", event
    ready = await until(
        lambda: condition(env.kube.get(ISVC, env.ns, "big") or {}, "Ready").get("status") == "True",
        30,
        "Ready=True on the placed replica",
    )
    assert ready
    body = await asyncio.to_thread(env.kube.get, ISVC, env.ns, "big")
    assert (body or {})["status"]["readyReplicas"] == 1
    assert condition(body or {}, "Degraded")["reason"] == "Unschedulable"
