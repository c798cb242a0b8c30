"""How many engine replicas a decision becomes, given which pods may go.

Scaling up is immediate; scaling down removes only pods that can go without losing work —
not-ready pods, then warm pods idle in the latest observation — steering the ReplicaSet with
pod-deletion costs, or, for LeaderWorkerSet groups (removed from the highest index, no cost
to steer by), counting only top groups that may go. A disaggregated service's prefill pool is
scaled the same way.
"""

from __future__ import annotations

from typing import NamedTuple

from kvfleet_kernel.schema import Json
from kvfleet_operator.kube import DEPLOYMENT, POD, Kube
from kvfleet_operator.render import desired_engine_replicas
from kvfleet_operator.render.common import GROUP_INDEX_LABEL, PREFILL, ROLE_LABEL, Owner
from kvfleet_operator.render.disaggregation import prefill_owner
from kvfleet_operator.scaling.autoscaler import Scaled
from kvfleet_operator.status import pod_ready

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
IDLE_DELETION_COST = "-1000"
"""Idle warm pods go first when the autoscaler lowers the engine replicas."""


def scaled_replicas(
    kube: Kube, owner: Owner, scaled: Scaled, current: int | None, pods: list[Json]
) -> int:
    """The engine Deployment's replicas for the autoscaler's decision. Up: at once. Down:
    only by pods that can go without losing work — pods not ready yet, then warm pods that
    were idle in the latest observation, which get the lowest pod-deletion-cost so the
    ReplicaSet removes exactly them; a demoted pod still finishing requests stays until it
    is idle (a later tick)."""
    target = desired_engine_replicas(owner, scaled.decision.desired_total)
    have = current if current is not None else target
    if target >= have:
        return target
    if owner.multi_node:
        return have - min(have - target, removable_groups(pods, scaled, have))
    unready = [p for p in pods if not pod_ready(p) and not p["metadata"].get("deletionTimestamp")]
    idle = scaled.idle
    idle_warm = [
        p
        for p in pods
        if pod_ready(p)
        and (p["metadata"].get("labels") or {}).get(ROLE_LABEL) == "warm"
        and p["metadata"]["name"] in idle
    ]
    surplus = have - target
    chosen = idle_warm[: max(0, surplus - len(unready))]
    for pod in chosen:
        annotations = pod["metadata"].get("annotations") or {}
        if annotations.get(DELETION_COST) != IDLE_DELETION_COST:
            kube.patch(
                POD,
                owner.namespace,
                pod["metadata"]["name"],
                {"metadata": {"annotations": {DELETION_COST: IDLE_DELETION_COST}}},
            )
    return have - min(surplus, len(unready) + len(chosen))


class PrefillPlan(NamedTuple):
    """A disaggregated service's prefill pool this reconcile."""

    scaled: Scaled | None
    """The autoscaler's latest decision (None: not autoscaled, or none yet)."""
    replicas: int
    """What its Deployment gets."""
    current: int | None = None
    """What its Deployment has (read only when autoscaled)."""


def prefill_pool(kube: Kube, owner: Owner, scaled: Scaled | None) -> PrefillPlan | None:
    """A disaggregated service's prefill pool: its latest decision (autoscaled) and the
    replicas its Deployment gets, scaled down as the engines are (idle warm pods first)."""
    if owner.spec.disaggregation is None:
        return None
    p_owner = prefill_owner(owner)
    if p_owner.spec.autoscaling is None:
        return PrefillPlan(None, desired_engine_replicas(p_owner))
    live = kube.get(DEPLOYMENT, owner.namespace, owner.prefill_name)
    current = ((live or {}).get("spec") or {}).get("replicas")
    if scaled is None:
        return PrefillPlan(None, desired_engine_replicas(p_owner, current), current)
    pods = kube.list(POD, owner.namespace, owner.selector_string(PREFILL))
    return PrefillPlan(scaled, scaled_replicas(kube, p_owner, scaled, current, pods), current)


def removable_groups(leaders: list[Json], scaled: Scaled, have: int) -> int:
    """LeaderWorkerSet removes the highest groups first (no deletion cost to steer it): how
    many of the top groups may go without losing work — each not ready yet, or a warm
    leader idle in the latest observation — counted down until one may not."""
    by_group = {
        int(index): p
        for p in leaders
        if (index := (p["metadata"].get("labels") or {}).get(GROUP_INDEX_LABEL, "")).isdigit()
    }
    idle, count = scaled.idle, 0
    for group in range(have - 1, -1, -1):
        pod = by_group.get(group)
        if pod is not None and pod_ready(pod):
            labels = pod["metadata"].get("labels") or {}
            if labels.get(ROLE_LABEL) != "warm" or pod["metadata"]["name"] not in idle:
                break
        count += 1
    return count
