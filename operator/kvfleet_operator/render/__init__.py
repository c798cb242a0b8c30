"""Pure renderers: an InferenceService in, the Kubernetes objects it owns out.

Nothing here reads the cluster; `render_children` is what `kvfleet render` prints and what
the operator applies.
"""

from __future__ import annotations

from typing import Any

from kvfleet_kernel.schema import ConfigError, Json, evaluate
from kvfleet_operator.gateway_spec import KVFLEET_IMAGE
from kvfleet_operator.render.common import (
    DEFAULT_OPERATOR_NAMESPACE,
    ENGINE,
    GATEWAY,
    PREFILL,
    Owner,
)
from kvfleet_operator.render.disaggregation import prefill_deployment, prefill_owner
from kvfleet_operator.render.engine import engine_deployment, engine_key_secret, model_cache_pvc
from kvfleet_operator.render.gateway import (
    gateway_config,
    gateway_configmap,
    gateway_deployment,
    gateway_rbac,
    gateway_service,
)
from kvfleet_operator.render.multinode import engine_leader_worker_set
from kvfleet_operator.render.network import (
    engine_network_policy,
    engine_pdb,
    engine_service,
    gateway_network_policy,
    pod_monitor,
)
from kvfleet_operator.spec import NAME_RULE, parse_spec

__all__ = [
    "Owner",
    "desired_engine_replicas",
    "engine_workload",
    "owner_of",
    "render_children",
]


def desired_engine_replicas(owner: Owner, current: int | None = None) -> int:
    """Engine pods to run. Manual: spec.replicas. Autoscaled: the autoscaler's last decision
    (`current`, the Deployment's replicas) kept within [min + warm, max]."""
    a = owner.spec.autoscaling
    if a is None:
        return owner.spec.manual_replicas
    floor = min(a.min_replicas + a.warm_replicas, a.max_replicas)
    return max(floor, min(a.max_replicas, current if current is not None else floor))


def engine_workload(owner: Owner, replicas: int) -> Json:
    """The engine replicas: a Deployment, or LeaderWorkerSet groups (nodesPerReplica > 1)."""
    if owner.multi_node:
        return engine_leader_worker_set(owner, replicas)
    return engine_deployment(owner, replicas)


def render_children(
    owner: Owner, engine_replicas: int | None = None, prefill_replicas: int | None = None
) -> list[Json]:
    """Every child object, in apply order (config before the pods that read it); the
    replica counts decided for the engines and a disaggregated service's prefill pool."""
    replicas = desired_engine_replicas(owner) if engine_replicas is None else engine_replicas
    out: list[Json] = []
    pvc = model_cache_pvc(owner)
    if pvc is not None:
        out.append(pvc)
    out += [
        engine_service(owner),
        engine_workload(owner, replicas),
        engine_pdb(owner),
        engine_network_policy(owner),
        pod_monitor(owner, ENGINE),
    ]
    if owner.spec.disaggregation is not None:
        if prefill_replicas is None:
            prefill_replicas = desired_engine_replicas(prefill_owner(owner))
        out += [
            prefill_deployment(owner, prefill_replicas),
            engine_network_policy(owner, PREFILL),
            pod_monitor(owner, PREFILL),
        ]
    out.insert(0, engine_key_secret(owner))  # before the pods that read it
    if owner.spec.gateway.own_gateway:
        config = gateway_configmap(owner, gateway_config(owner))
        out += [
            *gateway_rbac(owner),
            config,
            gateway_deployment(owner, config),
            gateway_service(owner, owner.spec.gateway),
            gateway_network_policy(owner),
            pod_monitor(owner, GATEWAY),
        ]
    return out


def owner_of(
    body: dict[str, Any],
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE,
    gateway_image: str = KVFLEET_IMAGE,
) -> Owner:
    """An InferenceService object (dict) → Owner, parsing its spec (raises ConfigError);
    `gateway_image`: the operator's own image, its gateways' unless the spec names one."""
    meta = body.get("metadata") or {}
    # The CRD's rule on the name, evaluated here as the API server does (an old server, or
    # `kvfleet render` of a file, never ran it).
    if not evaluate(NAME_RULE.rule, {"metadata": {"name": str(meta.get("name") or "")}}):
        raise ConfigError("metadata.name", NAME_RULE.message)
    return Owner(
        name=meta["name"],
        namespace=meta.get("namespace") or "default",
        uid=meta.get("uid") or "",
        spec=parse_spec(body.get("spec")),
        generation=int(meta.get("generation") or 1),
        operator_namespace=operator_namespace,
        gateway_image=gateway_image,
    )
