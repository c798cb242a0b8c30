"""What the API server makes of a CustomResourceDefinition: the resources it serves (one per
version, with its schema, scale subresource paths and names), the status the apiextensions
controllers report once it is served, and its printer columns for server-side tables."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import kmock

from kvfleet_localcluster.apitypes import Kind

CRD_GROUP, CRD_PLURAL = "apiextensions.k8s.io", "customresourcedefinitions"


@dataclass(frozen=True)
class ServedVersion:
    """One version of a CRD as the server serves it."""

    resource: kmock.resource
    info: kmock.ResourceInfo
    kind: Kind
    schema: dict[str, Any] | None
    """Its `openAPIV3Schema`, applied to every write."""


def served_versions(crd: dict[str, Any]) -> list[ServedVersion]:
    """Every version of the CRD; none when it names no group or plural."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group, plural = spec.get("group"), names.get("plural")
    if not group or not plural:
        return []
    namespaced = spec.get("scope", "Namespaced") == "Namespaced"
    out = []
    for version in spec.get("versions") or []:
        subs = version.get("subresources") or {}
        scale = subs.get("scale") or {}
        info = kmock.ResourceInfo(
            kind=names.get("kind"),
            singular=names.get("singular"),
            namespaced=namespaced,
            verbs={"list", "watch", "get", "create", "update", "patch", "delete"},
            shortnames=set(names.get("shortNames") or ()),
            categories=set(names.get("categories") or ()),
            subresources=set(subs),
        )
        kind = Kind(
            group,
            version["name"],
            plural,
            names.get("kind", ""),
            namespaced,
            frozenset(subs),
            scale.get("specReplicasPath", ".spec.replicas"),
            scale.get("statusReplicasPath", ".status.replicas"),
            scale.get("labelSelectorPath"),
        )
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        out.append(
            ServedVersion(kmock.resource(group, version["name"], plural), info, kind, schema)
        )
    return out


def established_status(crd: dict[str, Any], now: datetime | None = None) -> dict[str, Any]:
    """What the apiextensions controllers report once a CRD is served: its names accepted and
    the API established (`helm install` and `kubectl wait --for=condition=Established` wait
    for it)."""
    at = (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    spec = crd.get("spec") or {}
    return {
        "acceptedNames": spec.get("names") or {},
        "storedVersions": [v["name"] for v in spec.get("versions") or [] if v.get("storage")],
        "conditions": [
            {"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": at}
            for t, r, m in (
                ("NamesAccepted", "NoConflicts", "no conflicts found"),
                ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
            )
        ],
    }


def is_established(crd: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Established" and c.get("status") == "True"
        for c in (crd.get("status") or {}).get("conditions") or []
    )


def printer_columns(crds: list[dict[str, Any]], kind: Kind) -> list[dict[str, Any]] | None:
    """The `additionalPrinterColumns` of the CRD version that serves `kind` (None: a built-in
    kind, or a CRD that declares none)."""
    columns = None
    for crd in crds:
        spec = crd.get("spec") or {}
        if (spec.get("group"), (spec.get("names") or {}).get("plural")) == kind.key:
            for v in spec.get("versions") or []:
                if v.get("name") == kind.version:
                    columns = v.get("additionalPrinterColumns")
    return columns
