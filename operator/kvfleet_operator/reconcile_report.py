"""What a reconcile tells: Events for what it changed in the cluster, the status it writes
(only when it changed) with an Event for each condition that flipped and each change of the
decided size, and why pods wait (the object they miss, named)."""

from __future__ import annotations

import base64
import logging
from typing import TYPE_CHECKING

import yaml
from kubernetes.client.exceptions import ApiException

from kvfleet_gateway.config import parse_keys_file
from kvfleet_kernel.schema import ConfigError, Json
from kvfleet_operator.kube import EVENT, ISVC, POD, SECRET, Kube
from kvfleet_operator.render.common import ENGINE, GATEWAY, Owner, selector_string
from kvfleet_operator.render.gateway import KEYS_KEY
from kvfleet_operator.scaling.autoscaler import Scaled, report
from kvfleet_operator.status import Observed, compute_status, k8s_time, pod_ready, status_patch

if TYPE_CHECKING:  # the reconcile's own types (it imports this module)
    from kvfleet_operator.reconcile import Outcome, ReconcileOptions

log = logging.getLogger("kvfleet.operator")


def report_changes(
    kube: Kube,
    body: Json,
    out: Outcome,
    spec_changed: bool,
    options: ReconcileOptions,
    why: dict[str, str] | None = None,
) -> None:
    """Events for what this reconcile changed in the cluster; `why` says, per workload
    (kind/name), what decided its replicas."""
    for key, have, want in out.resized:
        # The operator's own resize says why; only a change by someone else is drift.
        reason = (why or {}).get(key, "")
        message = f"{key} {have} -> {want} replicas" + (f": {reason}" if reason else "")
        post_event(kube, body, "Normal", "Scaled", message, options)
    if out.created:
        post_event(kube, body, "Normal", "Created", "created " + ", ".join(out.created), options)
    if out.patched:
        # Without a spec change, a difference means someone edited a managed object.
        reason, kind = ("Updated", "Normal") if spec_changed else ("DriftRepaired", "Warning")
        post_event(kube, body, kind, reason, "updated " + ", ".join(out.patched), options)
    if out.pruned:
        post_event(kube, body, "Normal", "Pruned", "deleted " + ", ".join(out.pruned), options)


def held_by_references(kube: Kube, namespace: str, pods: list[Json]) -> tuple[str, ...]:
    """Why pods wait before their container starts, naming the missing object: a missing env
    source is in the container's waiting message; a volume that cannot mount only in the
    kubelet's FailedMount Event (read only for such pods, so a steady state reads nothing)."""
    out = []
    for pod in pods:
        if pod_ready(pod):
            continue
        name = pod["metadata"]["name"]
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") == "CreateContainerConfigError" and waiting.get("message"):
                out.append(f"pod {name}: {waiting['message']}")
            elif waiting.get("reason") == "ContainerCreating":
                fields = f"involvedObject.kind=Pod,involvedObject.name={name},reason=FailedMount"
                events = kube.list(EVENT, namespace, fields=fields)
                if events:
                    latest = max(events, key=lambda e: e.get("lastTimestamp") or "")
                    out.append(f"pod {name}: {latest.get('message', '')}")
            break  # one container per pod here
    return tuple(out)


def invalid_keys(kube: Kube, owner: Owner, gateway: Json | None) -> str | None:
    """Why the gateway refuses its API-key Secret, naming the field, with the gateway's own
    parser — read only while no gateway pod is ready (a gateway refuses a broken file at
    start; a running one keeps its previous keys), so a steady state reads nothing."""
    name = owner.spec.gateway.api_keys_secret
    if not name or gateway is None or int((gateway.get("status") or {}).get("readyReplicas") or 0):
        return None
    secret = kube.get(SECRET, owner.namespace, name, fresh=True)
    data = ((secret or {}).get("data") or {}).get(KEYS_KEY)
    if data is None:
        return None  # a missing Secret or key: the pod waits, and `held` says so
    origin = f"secret {name} {KEYS_KEY}"
    try:
        doc = yaml.safe_load(base64.b64decode(data))
    except (ValueError, yaml.YAMLError):
        return f"{origin}: not a YAML document"
    try:
        parse_keys_file(doc, origin)
    except ConfigError as exc:
        return str(exc)
    return None


def write_status(
    kube: Kube,
    body: Json,
    world: tuple[Owner, int, list[Json], dict[tuple[str, str], Json | None]] | None,
    out: Outcome,
    options: ReconcileOptions,
    scaled: Scaled | None = None,
) -> None:
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    selector = selector_string(name, ENGINE)
    old = body.get("status") or {}
    if world is None:
        status = compute_status(
            body, 0, selector, None, Observed(None, [], None), out.error, out.error_reason
        )
    else:
        owner, replicas, pods, applied = world
        engine = applied.get((owner.engine_kind, owner.engine_name))
        gateway = applied.get(("Deployment", owner.gateway_name))
        gateway_pods = kube.list(POD, ns, owner.selector_string(GATEWAY))
        held = held_by_references(kube, ns, [*pods, *gateway_pods])
        observed = Observed(
            engine, pods, gateway, held, tuple(out.conflicts), tuple(out.refused),
            invalid_keys(kube, owner, gateway),
        )  # fmt: skip
        scaling = None if scaled is None else report(scaled, old.get("autoscaling"))
        status = compute_status(
            body,
            replicas,
            selector,
            owner.gateway_url(),
            observed,
            scaling=scaling,
            keep_scaling=owner.spec.autoscaling is not None,
        )
    patch = status_patch(old, status)
    if patch is None:
        return
    kube.patch(ISVC, ns, name, {"status": patch}, "status")
    was, now_ = old.get("autoscaling") or {}, status.get("autoscaling") or {}
    sizes = ("desiredActive", "desiredWarm")
    if now_ and was and tuple(was.get(k) for k in sizes) != tuple(now_.get(k) for k in sizes):
        # One event per change of the decided size (the status records it, so an operator
        # restart that decides the same posts nothing).
        up = now_["desiredActive"] > (was.get("desiredActive") or 0)
        reason = "ScaledUp" if up else "ScaledDown"
        post_event(kube, body, "Normal", reason, now_.get("reason", ""), options)
    before = {c["type"]: c for c in old.get("conditions") or []}
    for cond in status["conditions"]:
        if cond["type"] not in ("Ready", "Degraded", "ScalingActive"):
            continue
        prev = before.get(cond["type"])
        bad = (cond["type"] == "Degraded") == (cond["status"] == "True")
        changed = prev is not None and (prev.get("status"), prev.get("reason")) != (
            cond["status"],
            cond["reason"],
        )
        # Transitions only (a start says nothing a `Created` event has not), and a spec
        # that is invalid from the first reconcile.
        if changed or (prev is None and cond["reason"] in FIRST_EVENT_REASONS):
            kind = "Warning" if bad else "Normal"
            post_event(kube, body, kind, cond["reason"], cond["message"], options)


FIRST_EVENT_REASONS = (
    "InvalidSpec",
    "PolicyViolation",
    "LeaderWorkerSetMissing",
    "NameConflict",
    "ReconcileError",
)
"""Conditions wrong from the first reconcile, worth an Event then (others: on transitions)."""


def post_event(
    kube: Kube, body: Json, type_: str, reason: str, message: str, options: ReconcileOptions
) -> None:
    meta = body["metadata"]
    now = k8s_time()
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": body["apiVersion"],
            "kind": body["kind"],
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": options.component},
        "reportingComponent": options.component,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        kube.create(event)
    except ApiException as exc:  # events are best-effort, as in every controller
        log.warning("cannot post event %s: %s", reason, exc.reason)
