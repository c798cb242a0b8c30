"""Engine pods the scheduler finds no node for (`PodScheduled=False, Unschedulable`): the
service's conditions say so with the scheduler's words, and the autoscaler counts such a
pod neither as capacity on the way nor as a spare to promote."""

from __future__ import annotations

from typing import Any

from kvfleet_operator.diff import warm_assignment
from kvfleet_operator.scaling.autoscaler import fleet_of
from kvfleet_operator.scaling.model import Fleet, ReplicaSignals, ScalingConfig, Signals, State
from kvfleet_operator.scaling.policy import decide
from kvfleet_operator.status import (
    Observed,
    compute_status,
    unschedulable,
    unschedulable_summary,
)

SELECTOR = "kvfleet.dev/inferenceservice=x,app.kubernetes.io/component=engine"
SHORTAGE = (
    "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are"
    " available: 3 No preemption victims found for incoming pod."
)
GATEWAY_NOT_READY: dict[str, Any] = {"status": {}}
GATEWAY_READY = {"status": {"readyReplicas": 1}}
DEPLOYMENT = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1}}


def ready_pod(name: str, role: str = "active") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"kvfleet.dev/role": role}},
        "status": {
            "phase": "Running",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True"},
            ],
        },
    }


def pending_pod(name: str, role: str = "warm", message: str = SHORTAGE) -> dict[str, Any]:
    """A pod as the real scheduler leaves it when no node has the GPUs it asks for."""
    return {
        "metadata": {"name": name, "labels": {"kvfleet.dev/role": role}},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": message,
                }
            ],
        },
    }


def loading_pod(name: str) -> dict[str, Any]:
    """Placed on a node, its model still loading: capacity on the way."""
    return {
        "metadata": {"name": name, "labels": {"kvfleet.dev/role": "warm"}},
        "status": {
            "phase": "Running",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "False"},
            ],
        },
    }


def conds(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_the_scheduler_message_is_read_only_from_an_unschedulable_pod() -> None:
    assert unschedulable(pending_pod("a")) == SHORTAGE
    assert unschedulable(ready_pod("a")) is None
    assert unschedulable(loading_pod("a")) is None
    gone = pending_pod("a")
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert unschedulable(gone) is None
    assert unschedulable_summary([ready_pod("a")]) is None
    two = unschedulable_summary([pending_pod("b"), ready_pod("a"), pending_pod("c")])
    assert two == f"2 engine pods cannot be scheduled (b, c): {SHORTAGE}"


def test_no_engine_placed_is_unschedulable_not_a_gateway_problem() -> None:
    """Nothing serves because no node has the GPUs: Ready and Degraded say so with the
    scheduler's words (the gateway is unready only because no engine answers it)."""
    seen = Observed(DEPLOYMENT, [pending_pod("x-engine-1")], GATEWAY_NOT_READY)
    st = compute_status({"metadata": {"name": "x", "generation": 1}}, 1, SELECTOR, None, seen)
    c = conds(st)
    want = f"1 engine pod cannot be scheduled (x-engine-1): {SHORTAGE}"
    assert (c["Ready"]["status"], c["Ready"]["reason"], c["Ready"]["message"]) == (
        "False",
        "Unschedulable",
        want,
    )
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "Unschedulable")
    assert "Insufficient nvidia.com/gpu" in c["Degraded"]["message"]
    assert st["readyReplicas"] == 0 and st["replicas"] == 1
    again = compute_status(
        {"metadata": {"name": "x", "generation": 1}, "status": st}, 1, SELECTOR, None, seen
    )
    assert again == st  # unchanged world, nothing to write
    from tests.support.argocd import health

    assert health({"metadata": {"name": "x", "generation": 1}, "status": st}) == (
        "Degraded",
        want,
    )


def test_a_serving_fleet_with_an_unplaced_replica_is_degraded_and_failing_comes_first() -> None:
    seen = Observed(DEPLOYMENT, [ready_pod("a"), pending_pod("b")], GATEWAY_READY)
    c = conds(compute_status({"metadata": {"name": "x"}}, 2, SELECTOR, None, seen))
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("True", "Serving")
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "Unschedulable")
    crashing = loading_pod("c")
    crashing["status"]["containerStatuses"] = [
        {"restartCount": 2, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
    ]
    seen = Observed(DEPLOYMENT, [ready_pod("a"), pending_pod("b"), crashing], GATEWAY_READY)
    c = conds(compute_status({"metadata": {"name": "x"}}, 3, SELECTOR, None, seen))
    assert c["Degraded"]["reason"] == "ReplicasFailing"


def test_an_unschedulable_pod_is_not_capacity_on_the_way() -> None:
    pods = [ready_pod("a"), pending_pod("b"), loading_pod("c")]
    assert fleet_of(pods) == Fleet(active=1, warm=0, starting=1)


def test_a_queue_orders_replicas_past_a_pod_no_node_fits() -> None:
    """A scale-up ordered a moment ago went Pending for lack of GPUs: the growing queue is
    not 'capacity late', it is capacity missing, and it is ordered (counted as starting, the
    pod would hold the queue's term at the current size for a whole cold start)."""
    config = ScalingConfig(min_replicas=1, max_replicas=8, scale_up_window_s=0)
    now = 1000.0
    state = State(desired_active=1, last_up=now - 15, since=0.0)
    sig = Signals((ReplicaSignals("a", 40.0, 8.0, 0.2),))
    fleet = fleet_of([ready_pod("a"), pending_pod("b")])
    decided, _ = decide(config, state, fleet, sig, now)
    held, _ = decide(config, state, Fleet(active=1, warm=0, starting=1), sig, now)
    assert held.desired_active == 1  # what counting the Pending pod as starting gave
    assert decided.desired_active > 1, decided.reason


def test_a_warm_spare_no_node_fits_is_never_promoted() -> None:
    """Autoscaled pods start labelled warm: one still Pending is not a spare to promote; the
    placed, ready pods take the traffic."""
    pods = [ready_pod("a"), pending_pod("b", role="warm"), ready_pod("c", role="warm")]
    assert warm_assignment(pods, warm_target=1, active_target=2) == {
        "a": "active",
        "c": "active",
    }
    assert fleet_of(pods).warm == 1
