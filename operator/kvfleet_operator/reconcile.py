"""One reconcile of one InferenceService: read, compare, write only what differs.

Synchronous (the `kubernetes` client is); the handlers call it from a worker thread, one
reconcile at a time per object. Steps: parse the spec (a bad one becomes `Ready=False` with
the field's name), apply each child (server-side apply, sent only when a rendered field
differs or the operator owns a field it no longer renders), assign warm/active roles to
ready engine pods, then write the status — only when it changed — and post an Event for
each condition that flipped (`reconcile_report.py`).
"""

from __future__ import annotations

import base64
import dataclasses
import logging
from dataclasses import dataclass, field

from kubernetes.client.exceptions import ApiException

from kvfleet_kernel.schema import ConfigError, Json
from kvfleet_operator.diff import (
    adopted_managed_fields,
    field_owners,
    needs_apply,
    own_resize,
    upgraded_managed_fields,
    warm_assignment,
)
from kvfleet_operator.gateway_spec import KVFLEET_IMAGE
from kvfleet_operator.kube import (
    DEPLOYMENT,
    ISVC,
    LEADER_WORKER_SET,
    POD,
    PRUNABLE,
    SECRET,
    Kube,
    api_status,
    resource_of,
)
from kvfleet_operator.policy import Policy, PolicyViolation, check_policy
from kvfleet_operator.reconcile_report import post_event, report_changes, write_status
from kvfleet_operator.render import desired_engine_replicas, owner_of, render_children
from kvfleet_operator.render.common import (
    DEFAULT_OPERATOR_NAMESPACE,
    ENGINE_KEY_KEY,
    ISVC_LABEL,
    PREFILL,
    ROLE_LABEL,
    Owner,
)
from kvfleet_operator.render.disaggregation import prefill_owner
from kvfleet_operator.replicas import PrefillPlan, prefill_pool, scaled_replicas
from kvfleet_operator.scaling.autoscaler import Scaled

log = logging.getLogger("kvfleet.operator")


@dataclass(frozen=True)
class ReconcileOptions:
    pod_monitors: bool = True
    """Render PodMonitors (only when the API server serves monitoring.coreos.com/v1)."""
    leader_worker_sets: bool = True
    """The API server served leaderworkerset.x-k8s.io/v1 when the operator started (and the
    operator watches it): multi-node services can be rendered."""
    component: str = "kvfleet-operator"
    """Event source name."""
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE
    """Where the operator runs (the NetworkPolicies admit its metrics reads from there)."""
    gateway_image: str = KVFLEET_IMAGE
    """The operator's own image: the gateways' when a spec names none."""
    policy: Policy = field(default_factory=Policy)
    """What a spec may set (images, tolerations, ...): the platform team's bounds."""


@dataclass
class Outcome:
    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    resized: list[tuple[str, int, int]] = field(default_factory=list)
    """Workloads the operator resized and changed nothing else of: (kind/name, from, to)."""
    relabelled: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    """Children whose names are held by objects this InferenceService does not control."""
    refused: list[str] = field(default_factory=list)
    """Children the API server refused to create or repair (kind, name, its message)."""
    error: str | None = None
    error_reason: str = "InvalidSpec"
    """The Ready condition's reason when `error` is set (PolicyViolation: the policy refused)."""


class LeaderWorkerSetMissing(ConfigError):
    """A multi-node service on a cluster without LeaderWorkerSet: reported, nothing applied."""


class ChildrenRefused(RuntimeError):
    """The API server refused some children: reported in status, retried with backoff."""


REFUSALS = frozenset({400, 403, 404, 422})
"""Answers that repeat until something changes (the spec, RBAC, a quota): reported in status.
Others (409 races, 429, 5xx, timeouts) are retried without a word in status."""


def _refusal(desired: Json, exc: ApiException) -> str:
    message = api_status(exc).get("message") or exc.reason
    return f"{desired['kind']} {desired['metadata']['name']}: {exc.status} {message}"


def _key(obj: Json) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def reconcile(
    kube: Kube,
    namespace: str,
    name: str,
    options: ReconcileOptions,
    scaled: Scaled | None = None,
    prefill_scaled: Scaled | None = None,
) -> Outcome:
    """One reconcile; `scaled` is the autoscaler's latest decision for this service's
    engines, `prefill_scaled` for a disaggregated service's prefill pool."""
    out = Outcome()
    body = kube.get(ISVC, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return out  # children go with it through their ownerReferences
    try:
        owner = owner_of(body, options.operator_namespace, options.gateway_image)
        check_policy(owner.spec, options.policy)
        if owner.multi_node and not options.leader_worker_sets:
            raise LeaderWorkerSetMissing(
                "spec.engine.nodesPerReplica",
                f"{owner.spec.engine.nodes_per_replica} nodes per replica run as LeaderWorkerSet"
                " groups, and this cluster did not serve leaderworkerset.x-k8s.io/v1 when the"
                " operator started: install LeaderWorkerSet, then restart the operator",
            )
        owner = _with_engine_key(kube, owner)
        workload = LEADER_WORKER_SET if owner.multi_node else DEPLOYMENT
        engine_live = kube.get(workload, namespace, owner.engine_name)
        current = ((engine_live or {}).get("spec") or {}).get("replicas")
        if owner.spec.autoscaling is None:
            scaled = None
        pods = kube.list(POD, namespace, owner.replica_selector_string())
        replicas = desired_engine_replicas(owner, current)
        if scaled is not None:
            replicas = scaled_replicas(kube, owner, scaled, current, pods)
        if owner.spec.autoscaling is not None and _scaled_by_hand(kube, engine_live):
            # Never decided: back to the last decision whole (before any, the one recorded).
            recorded = (body.get("status") or {}).get("autoscaling") or {}
            total = (
                scaled.decision.desired_total
                if scaled is not None
                else int(recorded.get("desiredActive") or 0) + int(recorded.get("desiredWarm") or 0)
            )
            if total > 0 or scaled is not None:
                replicas = desired_engine_replicas(owner, total)
        prefill = prefill_pool(kube, owner, prefill_scaled)
        children = render_children(owner, replicas, prefill.replicas if prefill else None)
        _prefill_scaled_event(kube, body, prefill, options)
        _manual_scale(kube, body, owner, engine_live, replicas, options)
    except ConfigError as exc:
        out.error = str(exc)
        if isinstance(exc, PolicyViolation):
            out.error_reason = "PolicyViolation"
        elif isinstance(exc, LeaderWorkerSetMissing):
            out.error_reason = "LeaderWorkerSetMissing"
        write_status(kube, body, None, out, options)
        return out
    children = [c for c in children if c["kind"] != "PodMonitor" or options.pod_monitors]
    # What each child is after this reconcile (the engine workload was read above).
    applied: dict[tuple[str, str], Json | None] = {
        (owner.engine_kind, owner.engine_name): engine_live
    }
    apply_children(kube, children, out, applied)
    spec_changed = (body.get("status") or {}).get("observedGeneration") != owner.generation
    if spec_changed:  # only a new spec can stop rendering a child: steady state costs nothing
        _prune(kube, owner, children, out, options)
    reasons = {f"{owner.engine_kind}/{owner.engine_name}": scaled}
    if prefill is not None:
        reasons[f"Deployment/{owner.prefill_name}"] = prefill.scaled
    why = {k: v.decision.reason if v else "the spec's replicas" for k, v in reasons.items()}
    report_changes(kube, body, out, spec_changed, options, why)
    if out.created or out.patched:  # the Deployment may have added or removed pods
        pods = kube.list(POD, namespace, owner.replica_selector_string())
    _assign_roles(kube, owner, pods, replicas, out, scaled)
    if prefill is not None:  # the prefill pool's warm spares, as the engines'
        p_owner = prefill_owner(owner)
        p_pods = kube.list(POD, namespace, owner.selector_string(PREFILL))
        _assign_roles(kube, p_owner, p_pods, prefill.replicas, out, prefill.scaled,
                      owner.selector_string(PREFILL))  # fmt: skip
    write_status(kube, body, (owner, replicas, pods, applied), out, options, scaled)
    if out.refused:
        raise ChildrenRefused("; ".join(out.refused))
    return out


def apply_children(
    kube: Kube, children: list[Json], out: Outcome, applied: dict[tuple[str, str], Json | None]
) -> None:
    """Apply each child in order, recording what it is now in `applied`; a refusal that will
    repeat (`REFUSALS`) is recorded in `out` and the others still applied."""
    for child in children:
        key = (child["kind"], child["metadata"]["name"])
        try:
            applied[key] = _apply(kube, child, out, applied)
        except ApiException as exc:
            if exc.status not in REFUSALS:
                raise
            out.refused.append(_refusal(child, exc))
            applied.setdefault(key, None)


def _with_engine_key(kube: Kube, owner: Owner) -> Owner:
    """The owner with the engines' API key its Secret already holds, so a reconcile renders
    the same key again (and writes nothing); a fresh key when there is none yet."""
    name = owner.engine_key_secret
    live = kube.get(SECRET, owner.namespace, name) or kube.get(
        SECRET, owner.namespace, name, fresh=True
    )
    if live is None or not may_manage(live, owner.uid, owner.name):
        return owner
    encoded = (live.get("data") or {}).get(ENGINE_KEY_KEY)
    try:
        key = base64.b64decode(encoded, validate=True).decode() if encoded else ""
    except (ValueError, UnicodeDecodeError):
        key = ""
    return dataclasses.replace(owner, engine_key=key) if key else owner


def _prefill_scaled_event(
    kube: Kube, body: Json, prefill: PrefillPlan | None, options: ReconcileOptions
) -> None:
    """An Event when the autoscaler resizes the prefill pool (the status reports the
    engines' decision; this says the prefill pool's)."""
    if prefill is None or prefill.scaled is None:
        return
    have = prefill.current
    if have is None or have == prefill.replicas:
        return
    reason = "PrefillScaledUp" if prefill.replicas > have else "PrefillScaledDown"
    message = f"prefill pool {have} -> {prefill.replicas}: {prefill.scaled.decision.reason}"
    post_event(kube, body, "Normal", reason, message, options)


def _scaled_by_hand(kube: Kube, live: Json | None) -> list[str]:
    """Who else owns the engine Deployment's replicas (nobody, normally)."""
    if live is None:
        return []
    owners = field_owners(live, ("f:spec", "f:replicas"))
    return [m for m in owners if m.split(" ")[0] != kube.field_manager]


def _manual_scale(kube: Kube, body: Json, owner: Owner, live: Json | None, replicas: int,
                  options: ReconcileOptions) -> None:  # fmt: skip
    """An autoscaled engine Deployment scaled by someone else (`kubectl scale`, an HPA):
    the apply that follows takes its replicas back; a Warning Event says so, and what to
    change instead, rather than fighting silently."""
    if owner.spec.autoscaling is None or live is None:
        return
    have = (live.get("spec") or {}).get("replicas")
    others = _scaled_by_hand(kube, live)
    if others and have != replicas:
        post_event(
            kube, body, "Warning", "ManualScaleReverted",
            f"{owner.engine_kind}/{owner.engine_name} was scaled to {have} by {', '.join(others)}; "
            f"spec.autoscaling owns its replicas ({replicas} decided): change minReplicas or "
            "maxReplicas instead",
            options,
        )  # fmt: skip


ADOPT_ANNOTATION = "kvfleet.dev/adopt"
"""On an existing object: the name of the InferenceService allowed to take it over."""


def controlled_by(live: Json, owner_uid: str) -> bool:
    """Whether `live`'s controller reference is the InferenceService `owner_uid`."""
    refs = (live.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("controller") and ref.get("uid") == owner_uid for ref in refs)


def may_manage(live: Json, owner_uid: str, owner_name: str) -> bool:
    """Whether the operator may change `live` for the InferenceService `owner_uid`: it is
    that service's (its controller reference), or its owner asked for a takeover. Anything
    else — a user's Service, another controller's Deployment — is never patched, so a name
    clash cannot redirect it or have it garbage-collected with the InferenceService."""
    if controlled_by(live, owner_uid):
        return True
    annotations = (live.get("metadata") or {}).get("annotations") or {}
    return annotations.get(ADOPT_ANNOTATION) == owner_name


def _apply(
    kube: Kube, desired: Json, out: Outcome, known: dict[tuple[str, str], Json | None]
) -> Json | None:
    """Create or repair one child by server-side apply; returns it as the API server now
    holds it (None: its name is taken by an object we may not touch). `known` holds
    children already read in this reconcile (no second GET)."""
    res = resource_of(desired)
    meta = desired["metadata"]
    key = (desired["kind"], meta["name"])
    ref = meta["ownerReferences"][0]
    live = known[key] if key in known else kube.get(res, meta["namespace"], meta["name"])
    if live is None or not may_manage(live, ref["uid"], ref["name"]):
        # Ask the API server: the cache's watches see only labelled objects, so a foreign
        # object of this name (or an adopt annotation added since) would go unseen — and an
        # apply would merge into it. (An object created between this read and the apply
        # is merged into: the window is one round trip, as for any SSA controller.)
        live = kube.get(res, meta["namespace"], meta["name"], fresh=True)
    if live is not None and not may_manage(live, ref["uid"], ref["name"]):
        out.conflicts.append(
            f"{desired['kind']} {meta['name']} exists and is not controlled by this "
            f"InferenceService: left untouched (annotate it {ADOPT_ANNOTATION}="
            f"{ref['name']} to let the operator take it over)"
        )
        return None
    if live is not None and not controlled_by(live, ref["uid"]):
        # Adopted (the annotation): every field becomes the operator's, as if it had made it.
        live = _take_over_updates(kube, live, adopted_managed_fields(live, kube.field_manager))
    elif live is not None and (upgraded := upgraded_managed_fields(live, kube.field_manager)):
        live = _take_over_updates(kube, live, upgraded)
    if not needs_apply(desired, live, kube.field_manager):
        return live
    resize = own_resize(desired, live, kube.field_manager)
    result = kube.apply(desired)  # 4xx: refused
    if live is None:
        out.created.append(_key(desired))
    elif result["metadata"].get("resourceVersion") == live["metadata"].get("resourceVersion"):
        pass  # the server found nothing to change
    elif resize is not None:
        out.resized.append((_key(desired), *resize))
    else:
        out.patched.append(_key(desired))
    return result


def _take_over_updates(kube: Kube, live: Json, upgraded: list[Json]) -> Json:
    """Move what an earlier operator wrote by Update into our Apply entry. Written a moment
    ago by someone else (the patch's resourceVersion test fails): read it again, and leave
    the move to the next reconcile, which sees the entry still there."""
    try:
        return kube.replace_managed_fields(live, upgraded)
    except ApiException as exc:
        if exc.status not in (409, 422):
            raise
        meta = live["metadata"]
        fresh = kube.get(resource_of(live), meta.get("namespace"), meta["name"], fresh=True)
        return fresh if fresh is not None else live


def _prune(
    kube: Kube, owner: Owner, children: list[Json], out: Outcome, options: ReconcileOptions
) -> None:
    """Delete children this InferenceService owns but no longer renders (a disabled gateway).
    The model-cache PVC is kept: it holds downloaded weights."""
    wanted = {(c["kind"], c["metadata"]["name"]) for c in children}
    for res in PRUNABLE:
        if res.kind == "PodMonitor" and not options.pod_monitors:
            continue
        try:
            found = kube.list(res, owner.namespace, f"{ISVC_LABEL}={owner.name}")
        except ApiException as exc:
            if exc.status == 404:  # an API this cluster does not serve (LeaderWorkerSet)
                continue
            raise
        for obj in found:
            meta = obj["metadata"]
            owned = any(r.get("uid") == owner.uid for r in meta.get("ownerReferences") or [])
            if owned and (res.kind, meta["name"]) not in wanted:
                kube.delete(res, owner.namespace, meta["name"])
                out.pruned.append(f"{res.kind}/{meta['name']}")


def _assign_roles(
    kube: Kube,
    owner: Owner,
    pods: list[Json],
    replicas: int,
    out: Outcome,
    scaled: Scaled | None,
    selector: str | None = None,
) -> None:
    """Warm and active roles of ready pods (`selector`: whose, when not the engines)."""
    a = owner.spec.autoscaling
    if scaled is not None:
        # Every ready pod beyond the decided active ones is warm: the pool, and pods being
        # demoted on their way out (they finish their requests, then go when idle).
        warm_target, active_target = len(pods), scaled.decision.desired_active
    else:
        warm_target = a.warm_replicas if a else 0
        active_target = max(0, replicas - warm_target)
    roles = warm_assignment(
        pods, warm_target, active_target, scaled.in_flight if scaled is not None else None
    )
    for pod in pods:
        name = pod["metadata"]["name"]
        role = roles.get(name)
        if role is None or (pod["metadata"].get("labels") or {}).get(ROLE_LABEL) == role:
            continue
        kube.patch(POD, owner.namespace, name, {"metadata": {"labels": {ROLE_LABEL: role}}})
        out.relabelled.append(f"{name}={role}")
    if out.relabelled:
        pods[:] = kube.list(POD, owner.namespace, selector or owner.replica_selector_string())
