"""One reconcile of one InferenceGateway: render its gateway from the InferenceServices that
name it, apply what differs, and report which services and models it serves.

The same steps as an InferenceService's (`reconcile.py`): children applied by server-side
apply only when a rendered field differs, never onto an object it does not control, Events
for what changed, and a status written only when it changed. A service whose spec is
invalid, whose engines' key does not exist yet, or which claims a name (served name, alias,
adapter) an earlier service serves here, is left out and named in the status; the others
are served. Each service gets a Routed condition (with a Warning Event when it is left out
for a conflict).
"""

from __future__ import annotations

import base64
import dataclasses
import logging
from dataclasses import dataclass, field

from kvfleet_kernel.schema import ConfigError, Json, to_json
from kvfleet_operator.kube import DEPLOYMENT, IGW, ISVC, SECRET, Kube
from kvfleet_operator.policy import check_gateway_policy
from kvfleet_operator.reconcile import (
    ChildrenRefused,
    Outcome,
    ReconcileOptions,
    apply_children,
)
from kvfleet_operator.reconcile_report import post_event, report_changes
from kvfleet_operator.render import owner_of
from kvfleet_operator.render.common import ENGINE_KEY_KEY, GATEWAY_PORT
from kvfleet_operator.render.shared_gateway import (
    Fronted,
    GatewayOwner,
    admit,
    gateway_owner_of,
    render_shared_gateway,
)
from kvfleet_operator.status import ROUTED, InferenceGatewayStatus, condition, status_patch

log = logging.getLogger("kvfleet.operator")


@dataclass
class Fleet:
    """The services that name a gateway: those it serves, and those it cannot yet."""

    served: list[Fronted] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    """`<name>: <why>` of each service named here but not served."""
    bodies: dict[str, Json] = field(default_factory=dict)
    """Each valid service's object, by name (its Routed condition is written here)."""
    refused: dict[str, str] = field(default_factory=dict)
    """Why each valid service the gateway cannot serve beside the others is left out."""


def fronted_services(kube: Kube, gw: GatewayOwner, operator_namespace: str) -> Fleet:
    """The InferenceServices of the gateway's namespace whose spec.gateway.inferenceGateway
    names it, each with its engines' key."""
    fleet = Fleet()
    for body in kube.list(ISVC, gw.namespace):
        gateway = ((body.get("spec") or {}).get("gateway") or {}).get("inferenceGateway")
        name = body["metadata"]["name"]
        if gateway != gw.name or body["metadata"].get("deletionTimestamp"):
            continue
        try:
            owner = owner_of(body, operator_namespace)
        except ConfigError as exc:
            fleet.left_out.append(f"{name}: invalid spec ({exc})")
            continue
        secret = kube.get(SECRET, gw.namespace, owner.engine_key_secret)
        key = ((secret or {}).get("data") or {}).get(ENGINE_KEY_KEY)
        if not key:
            fleet.left_out.append(f"{name}: its engines' key is not created yet")
            continue
        created = str(body["metadata"].get("creationTimestamp") or "")
        fleet.served.append(Fronted(owner, base64.b64decode(key).decode(), created))
        fleet.bodies[name] = body
    fleet.served, fleet.refused = admit(gw, fleet.served)
    fleet.left_out += [f"{name}: {why}" for name, why in fleet.refused.items()]
    return fleet


def reconcile_gateway(kube: Kube, namespace: str, name: str, options: ReconcileOptions) -> Outcome:
    out = Outcome()
    body = kube.get(IGW, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return out  # children go with it through their ownerReferences
    fleet = Fleet()
    try:
        gw = gateway_owner_of(body, options.operator_namespace, options.gateway_image)
        check_gateway_policy("spec", gw.spec, options.policy)
        fleet = fronted_services(kube, gw, options.operator_namespace)
        children = render_shared_gateway(gw, fleet.served)
    except ConfigError as exc:
        out.error = str(exc)
        _write_gateway_status(kube, body, None, fleet, out, options)
        return out
    children = [c for c in children if c["kind"] != "PodMonitor" or options.pod_monitors]
    applied: dict[tuple[str, str], Json | None] = {}
    apply_children(kube, children, out, applied)
    spec_changed = (body.get("status") or {}).get("observedGeneration") != gw.generation
    pools = f"Secret/{gw.pools_secret}"
    if pools in out.patched:  # the services changed, not the object: no drift
        out.patched.remove(pools)
        names = ", ".join(sorted(f.owner.name for f in fleet.served)) or "none"
        post_event(kube, body, "Normal", "PoolsChanged", f"serving: {names}", options)
    report_changes(kube, body, out, spec_changed, options)
    deployment = applied.get((DEPLOYMENT.kind, gw.gateway_name))
    _write_gateway_status(kube, body, (gw, deployment), fleet, out, options)
    for name, service in fleet.bodies.items():
        _write_routed(kube, gw, service, fleet.refused.get(name), options)
    if out.refused:
        raise ChildrenRefused("; ".join(out.refused))
    return out


def _write_gateway_status(
    kube: Kube,
    body: Json,
    world: tuple[GatewayOwner, Json | None] | None,
    fleet: Fleet,
    out: Outcome,
    options: ReconcileOptions,
) -> None:
    meta = body["metadata"]
    old = body.get("status") or {}
    previous = old.get("conditions") or []
    generation = int(meta.get("generation") or 1)
    status = InferenceGatewayStatus(observed_generation=generation)
    if world is None:
        reason, message, ok = "InvalidSpec", out.error or "invalid", False
    else:
        gw, deployment = world
        ready = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
        status = dataclasses.replace(
            status,
            url=f"http://{gw.gateway_service}.{gw.namespace}.svc:{GATEWAY_PORT}/v1",
            ready_replicas=ready,
            services=tuple(sorted(f.owner.name for f in fleet.served)),
            models=tuple(sorted(n for f in fleet.served for n in _names(f))),
        )
        ok = ready >= 1 and not out.conflicts and not out.refused
        reason = "Ready" if ok else "GatewayNotReady"
        message = f"serving {len(fleet.served)} services" if ok else "no gateway pod is ready yet"
        if out.conflicts or out.refused:
            reason, message = "ChildrenBlocked", "; ".join(out.conflicts + out.refused)
    ready_cond = condition(previous, "Ready", ok, reason, message, generation)
    status = dataclasses.replace(
        status, left_out=tuple(sorted(fleet.left_out)), conditions=(ready_cond,)
    )
    patch = status_patch(old, to_json(status))
    if patch is None:
        return
    kube.patch(IGW, meta["namespace"], meta["name"], {"status": patch}, "status")
    # Transitions of Ready only (a gateway starting is not a warning).
    before = next((c for c in previous if c.get("type") == "Ready"), None)
    if before is not None and (before.get("status") == "True") != ok:
        post_event(kube, body, "Normal" if ok else "Warning", reason, message, options)


def _names(f: Fronted) -> list[str]:
    return f.names()


def _write_routed(
    kube: Kube, gw: GatewayOwner, body: Json, refused: str | None, options: ReconcileOptions
) -> None:
    """The service's Routed condition: served by the gateway, or left out and why (with a
    Warning Event when it becomes so). Its own reconcile keeps this condition as written."""
    meta = body["metadata"]
    previous = list((body.get("status") or {}).get("conditions") or [])
    generation = int(meta.get("generation") or 1)
    if refused is None:
        reason, message = "Served", f"served by InferenceGateway {gw.name}"
    else:
        reason, message = "NameConflict", refused
    routed = to_json(condition(previous, ROUTED, refused is None, reason, message, generation))
    before = next((c for c in previous if c.get("type") == ROUTED), None)
    if before is not None and {**before, "lastTransitionTime": ""} == {
        **routed, "lastTransitionTime": "",
    }:  # fmt: skip
        return
    conditions = [c for c in previous if c.get("type") != ROUTED] + [routed]
    kube.patch(ISVC, meta["namespace"], meta["name"], {"status": {"conditions": conditions}},
               "status")  # fmt: skip
    if refused is not None and (before is None or before.get("status") != "False"):
        event_body = {"apiVersion": ISVC.api_version, "kind": ISVC.kind, **body}
        post_event(kube, event_body, "Warning", "NameConflict", refused, options)
