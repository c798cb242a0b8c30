"""The StatefulSet controller, as Kubernetes runs it with `podManagementPolicy: OrderedReady`
(the default): pods named `<set>-0`, `<set>-1`, ... created one at a time, each once the one
before is Ready; removed from the highest ordinal down; a changed template rolled from the
highest ordinal down, one pod at a time, each replaced once the rest are Ready. Every
volumeClaimTemplate gives each ordinal its own PersistentVolumeClaim
(`<template>-<set>-<ordinal>`), created before the pod and kept after it (the default
`persistentVolumeClaimRetentionPolicy`: Retain), so a replaced pod finds its data again.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any

from kvfleet_localcluster.apitypes import ApiError, Kind
from kvfleet_localcluster.kinds import CONFIG_KINDS, POD, STATEFULSET, is_ready, template_hash
from kvfleet_localcluster.store import Store

log = logging.getLogger("kvfleet.cluster.statefulsets")
Json = dict[str, Any]
REVISION_LABEL = "controller-revision-hash"
POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
PVC = CONFIG_KINDS["PersistentVolumeClaim"]


def default_statefulset(kind: Kind, obj: Json, old: str | None) -> None:
    """The API server's defaults for a StatefulSet (admission: on create and update), which
    `kubectl rollout status` and the controller read."""
    if kind.key != STATEFULSET.key:
        return
    spec = obj.setdefault("spec", {})
    spec.setdefault("replicas", 1)
    spec.setdefault("podManagementPolicy", "OrderedReady")
    spec.setdefault("revisionHistoryLimit", 10)
    strategy = spec.setdefault("updateStrategy", {"type": "RollingUpdate"})
    if strategy.get("type") == "RollingUpdate":
        strategy.setdefault("rollingUpdate", {"partition": 0})
    spec.setdefault(
        "persistentVolumeClaimRetentionPolicy", {"whenDeleted": "Retain", "whenScaled": "Retain"}
    )


def ordinal(sts_name: str, pod: Json) -> int | None:
    suffix = pod["metadata"]["name"][len(sts_name) + 1 :]
    return int(suffix) if suffix.isdigit() else None


def claim_name(template: Json, sts_name: str, index: int) -> str:
    return f"{template['metadata']['name']}-{sts_name}-{index}"


def _ensure_claims(store: Store, sts: Json, index: int) -> None:
    ns, name = sts["metadata"]["namespace"], sts["metadata"]["name"]
    for template in sts["spec"].get("volumeClaimTemplates") or []:
        claim = claim_name(template, name, index)
        if store.lookup(PVC.key, ns, claim) is not None:
            continue
        labels = dict((sts["spec"].get("selector") or {}).get("matchLabels") or {})
        body = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "labels": labels},
            "spec": copy.deepcopy(template.get("spec") or {}),
        }
        store.create(PVC, ns, body)


def _new_pod(store: Store, sts: Json, index: int, revision: str) -> None:
    name = sts["metadata"]["name"]
    pod = copy.deepcopy(sts["spec"].get("template") or {})
    meta = pod.setdefault("metadata", {})
    meta["name"] = f"{name}-{index}"
    meta["labels"] = {
        **(meta.get("labels") or {}),
        REVISION_LABEL: revision,
        POD_NAME_LABEL: meta["name"],
        POD_INDEX_LABEL: str(index),
    }
    meta["ownerReferences"] = [
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "name": name,
            "uid": sts["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    spec = pod.setdefault("spec", {})
    spec["hostname"] = meta["name"]
    if sts["spec"].get("serviceName"):
        spec["subdomain"] = sts["spec"]["serviceName"]
    volumes = spec.setdefault("volumes", [])
    for template in sts["spec"].get("volumeClaimTemplates") or []:
        volumes.append(
            {
                "name": template["metadata"]["name"],
                "persistentVolumeClaim": {"claimName": claim_name(template, name, index)},
            }
        )
    pod.pop("status", None)
    store.create(POD, sts["metadata"]["namespace"], pod)


def reconcile_statefulset(store: Store, sts: Json) -> None:
    meta, spec = sts["metadata"], sts.get("spec") or {}
    ns, name = meta["namespace"], meta["name"]
    want = int(spec.get("replicas", 1))
    revision = f"{name}-{template_hash(spec.get('template') or {})}"
    pods: dict[int, Json] = {}
    for p in store.owned_by(meta["uid"], POD.key):
        index = ordinal(name, p)
        if index is not None:
            pods[index] = p
    live = {i: p for i, p in pods.items() if not p["metadata"].get("deletionTimestamp")}
    settled = len(live) == len(pods)  # no pod is still terminating
    try:
        if settled:
            _step(store, sts, want, revision, live)
    except ApiError as exc:  # e.g. a quota or a missing ServiceAccount: retried next pass
        log.warning("statefulset %s/%s: %s", ns, name, exc.message)
    owned = [p for p in store.owned_by(meta["uid"], POD.key) if ordinal(name, p) is not None]
    ready = sum(1 for p in owned if is_ready(p))
    updated = sum(1 for p in owned if p["metadata"]["labels"].get(REVISION_LABEL) == revision)
    status = {
        "observedGeneration": meta["generation"],
        "replicas": len(owned),
        "readyReplicas": ready,
        "availableReplicas": ready,
        "currentReplicas": updated,
        "updatedReplicas": updated,
        "currentRevision": revision,
        "updateRevision": revision,
    }
    if (sts.get("status") or {}) != status:
        store.patch(STATEFULSET, ns, name, "merge", {"status": status}, "status")


def _step(store: Store, sts: Json, want: int, revision: str, live: dict[int, Json]) -> None:
    """One change at a time, as OrderedReady does: create the lowest missing ordinal once
    every lower one is Ready; else remove the highest surplus one; else replace the
    highest pod of an old revision once all are Ready."""
    ns = sts["metadata"]["namespace"]
    for index in range(want):
        if index not in live:
            _ensure_claims(store, sts, index)
            _new_pod(store, sts, index, revision)
            return
        if not is_ready(live[index]):
            return
    surplus = sorted((i for i in live if i >= want), reverse=True)
    if surplus:
        with contextlib.suppress(ApiError):
            store.delete(POD, ns, live[surplus[0]]["metadata"]["name"])
        return
    stale = [
        i
        for i in sorted(live, reverse=True)
        if live[i]["metadata"]["labels"].get(REVISION_LABEL) != revision
    ]
    if stale:
        with contextlib.suppress(ApiError):
            store.delete(POD, ns, live[stale[0]]["metadata"]["name"])
