"""The LeaderWorkerSet controller (leaderworkerset.x-k8s.io/v1), as LWS v0.9 behaves, once
its CRD is installed (`kubectl apply --server-side -f` of the CRD: the local cluster serves it
as any other CRD; this controller gives it life).

What it reproduces, for `replicas` groups of `leaderWorkerTemplate.size` pods:
* Group `i`'s leader is the pod `<set>-<i>` (from `leaderTemplate`, else `workerTemplate`),
  its workers `<set>-<i>-<j>` for j = 1..size-1 (from `workerTemplate`), created with the
  leader (`startupPolicy: LeaderCreated`; `LeaderReady` waits for a Ready leader). Workers are
  owned by their leader pod, so deleting a leader takes its workers with it.
* Every pod carries LWS's labels (`leaderworkerset.sigs.k8s.io/name`, `group-index`,
  `worker-index`, `group-key`, `template-revision-hash`) and, in every container, the
  environment LWS's webhook injects: `LWS_LEADER_ADDRESS` (`<set>-<i>.<subdomain>.<ns>`),
  `LWS_GROUP_SIZE`, `LWS_WORKER_INDEX`; `hostname` `<set>-<i>[-<j>]` and `subdomain` the
  set's headless Service, created (`publishNotReadyAddresses`) unless one of that name exists.
* `restartPolicy: RecreateGroupOnPodRestart` (the default): a container restart in any pod
  of a group, or a worker pod gone, deletes the group's leader — the whole group is created
  again, as a distributed engine that lost a rank cannot continue.
* Scaling removes the highest groups first; a changed template replaces groups from the
  highest index down, one at a time, once every other group is ready (LWS's rolling update
  with maxUnavailable 1; a surge group is not emulated).
* Status: `replicas` (leaders), `readyReplicas` (groups whose every pod is Ready),
  `updatedReplicas`, `hpaPodSelector`, `observedGeneration`, and the Available or
  Progressing condition; the scale subresource works through the CRD's declaration.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kvfleet_localcluster.apitypes import ApiError
from kvfleet_localcluster.kinds import POD, SERVICE, is_ready, template_hash
from kvfleet_localcluster.store import Store

log = logging.getLogger("kvfleet.cluster.leaderworkersets")
Json = dict[str, Any]
GROUP = "leaderworkerset.x-k8s.io"
KEY = (GROUP, "leaderworkersets")
PREFIX = "leaderworkerset.sigs.k8s.io/"
NAME_LABEL = PREFIX + "name"
GROUP_INDEX_LABEL = PREFIX + "group-index"
WORKER_INDEX_LABEL = PREFIX + "worker-index"
GROUP_KEY_LABEL = PREFIX + "group-key"
REVISION_LABEL = PREFIX + "template-revision-hash"
SIZE_ANNOTATION = PREFIX + "size"


def _owner_ref(obj: Json, kind: str, api_version: str) -> Json:
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": obj["metadata"]["name"],
        "uid": obj["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _pod(lws: Json, group: int, worker: int, revision: str, owner: Json) -> Json:
    """One pod of a group, as LWS's controllers and pod webhook make it."""
    meta, spec = lws["metadata"], lws["spec"]
    template_of = spec["leaderWorkerTemplate"]
    template = template_of.get("leaderTemplate") if worker == 0 else None
    pod = copy.deepcopy(template or template_of.get("workerTemplate") or {})
    name, ns = meta["name"], meta["namespace"]
    subdomain = name  # subdomainPolicy Shared: one headless Service named as the set
    leader = f"{name}-{group}"
    pod_name = leader if worker == 0 else f"{leader}-{worker}"
    size = int(template_of.get("size", 1))
    pmeta = pod.setdefault("metadata", {})
    pmeta["name"] = pod_name
    pmeta["labels"] = {
        **(pmeta.get("labels") or {}),
        NAME_LABEL: name,
        GROUP_INDEX_LABEL: str(group),
        WORKER_INDEX_LABEL: str(worker),
        GROUP_KEY_LABEL: hashlib.sha1(f"{ns}/{leader}".encode()).hexdigest(),
        REVISION_LABEL: revision,
    }
    pmeta["annotations"] = {**(pmeta.get("annotations") or {}), SIZE_ANNOTATION: str(size)}
    pmeta["ownerReferences"] = [
        _owner_ref(owner, "LeaderWorkerSet", f"{GROUP}/v1")
        if worker == 0
        else _owner_ref(owner, "Pod", "v1")
    ]
    pspec = pod.setdefault("spec", {})
    pspec["hostname"], pspec["subdomain"] = pod_name, subdomain
    injected = [
        {"name": "LWS_LEADER_ADDRESS", "value": f"{leader}.{subdomain}.{ns}"},
        {"name": "LWS_GROUP_SIZE", "value": str(size)},
        {"name": "LWS_WORKER_INDEX", "value": str(worker)},
    ]
    for container in pspec.get("containers") or []:
        have = {e.get("name") for e in container.get("env") or []}
        container["env"] = [e for e in injected if e["name"] not in have] + list(
            container.get("env") or []
        )
    pod.pop("status", None)
    return pod


def _restarted(pod: Json) -> bool:
    return any(
        int(s.get("restartCount", 0)) > 0
        for s in (pod.get("status") or {}).get("containerStatuses") or []
    )


@dataclass
class LeaderWorkerSets:
    """Reconciles LeaderWorkerSets in a store (called by the cluster's controller loop)."""

    store: Store
    _started: set[str] = field(default_factory=set)
    """Leader uids whose workers were created: a worker missing after that is a lost one."""

    def reconcile(self, lws: Json) -> None:
        meta, spec = lws["metadata"], lws.get("spec") or {}
        ns, name = meta["namespace"], meta["name"]
        want = int(spec.get("replicas", 1))
        size = int((spec.get("leaderWorkerTemplate") or {}).get("size", 1))
        revision = template_hash(spec.get("leaderWorkerTemplate") or {})
        try:
            self._ensure_service(lws)
            leaders = self._leaders(lws)
            groups = {i: self._group(ns, p, size) for i, p in leaders.items()}
            self._recreate_broken(ns, leaders, groups)
            self._step(lws, want, size, revision, leaders, groups)
        except ApiError as exc:  # a quota, a namespace going away: retried next pass
            log.warning("leaderworkerset %s/%s: %s", ns, name, exc.message)
        self._write_status(lws, want, revision)

    def _ensure_service(self, lws: Json) -> None:
        meta = lws["metadata"]
        if self.store.lookup(SERVICE.key, meta["namespace"], meta["name"]) is not None:
            return  # a Service of this name exists (the user's headless one is used as is)
        self.store.create(
            self.store.kinds[SERVICE.key],
            meta["namespace"],
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    "name": meta["name"],
                    "ownerReferences": [_owner_ref(lws, "LeaderWorkerSet", f"{GROUP}/v1")],
                },
                "spec": {
                    "clusterIP": "None",
                    "selector": {NAME_LABEL: meta["name"]},
                    "publishNotReadyAddresses": True,
                },
            },
        )

    def _leaders(self, lws: Json) -> dict[int, Json]:
        out = {}
        for pod in self.store.owned_by(lws["metadata"]["uid"], POD.key):
            index = (pod["metadata"].get("labels") or {}).get(GROUP_INDEX_LABEL, "")
            if index.isdigit() and not pod["metadata"].get("deletionTimestamp"):
                out[int(index)] = pod
        return out

    def _group(self, ns: str, leader: Json, size: int) -> list[Json | None]:
        """The group's pods by worker index (None: missing)."""
        pods: list[Json | None] = [leader, *([None] * (size - 1))]
        for pod in self.store.owned_by(leader["metadata"]["uid"], POD.key):
            index = (pod["metadata"].get("labels") or {}).get(WORKER_INDEX_LABEL, "")
            live = not pod["metadata"].get("deletionTimestamp")
            if index.isdigit() and 0 < int(index) < size and live:
                pods[int(index)] = pod
        return pods

    def _recreate_broken(
        self, ns: str, leaders: dict[int, Json], groups: dict[int, list[Json | None]]
    ) -> None:
        """RecreateGroupOnPodRestart: a restarted container or a lost worker recreates the
        group (its leader deleted; the workers go with it)."""
        for index, pods in list(groups.items()):
            leader = leaders[index]
            lost = leader["metadata"]["uid"] in self._started and any(p is None for p in pods)
            if lost or any(p is not None and _restarted(p) for p in pods):
                log.info("leaderworkerset: recreating group %s of %s", index, ns)
                self._started.discard(leader["metadata"]["uid"])
                with contextlib.suppress(ApiError):
                    self.store.delete(POD, ns, leader["metadata"]["name"])
                del leaders[index], groups[index]

    def _step(self, lws: Json, want: int, size: int, revision: str,
              leaders: dict[int, Json], groups: dict[int, list[Json | None]]) -> None:  # fmt: skip
        ns = lws["metadata"]["namespace"]
        policy = (lws.get("spec") or {}).get("startupPolicy", "LeaderCreated")
        for index in range(want):
            leader = leaders.get(index)
            if leader is None:
                self.store.create(POD, ns, _pod(lws, index, 0, revision, lws))
                continue
            if leader["metadata"]["uid"] in self._started:
                continue
            if policy == "LeaderReady" and not is_ready(leader):
                continue
            for worker in range(1, size):
                if groups[index][worker] is None:
                    self.store.create(POD, ns, _pod(lws, index, worker, revision, leader))
            self._started.add(leader["metadata"]["uid"])
        for index in sorted((i for i in leaders if i >= want), reverse=True):
            with contextlib.suppress(ApiError):
                self.store.delete(POD, ns, leaders[index]["metadata"]["name"])
        self._roll(ns, want, revision, leaders, groups)

    def _roll(self, ns: str, want: int, revision: str,
              leaders: dict[int, Json], groups: dict[int, list[Json | None]]) -> None:  # fmt: skip
        """Replace the highest group of an old template, once all groups are ready."""
        current = {i: g for i, g in groups.items() if i < want}
        if len(current) < want or not all(
            p is not None and is_ready(p) for g in current.values() for p in g
        ):
            return
        stale = [
            i
            for i in sorted(current, reverse=True)
            if (leaders[i]["metadata"].get("labels") or {}).get(REVISION_LABEL) != revision
        ]
        if stale:
            with contextlib.suppress(ApiError):
                self.store.delete(POD, ns, leaders[stale[0]]["metadata"]["name"])

    def _write_status(self, lws: Json, want: int, revision: str) -> None:
        meta = lws["metadata"]
        ns, name = meta["namespace"], meta["name"]
        size = int(((lws.get("spec") or {}).get("leaderWorkerTemplate") or {}).get("size", 1))
        leaders = self._leaders(lws)
        ready = updated = 0
        for pod in leaders.values():
            group = self._group(ns, pod, size)
            if all(p is not None and is_ready(p) for p in group):
                ready += 1
            if (pod["metadata"].get("labels") or {}).get(REVISION_LABEL) == revision:
                updated += 1
        available = ready >= want and updated >= want
        kind = "Available" if available else "Progressing"
        old = lws.get("status") or {}
        previous = {c.get("type"): c for c in old.get("conditions") or []}.get(kind) or {}
        condition = {
            "type": kind,
            "status": "True",
            "reason": "AllGroupsReady" if available else "GroupsProgressing",
            "message": "All replicas are ready" if available else "Replicas are progressing",
            "observedGeneration": meta.get("generation", 1),
            "lastTransitionTime": previous.get("lastTransitionTime")
            or datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        status: Json = {
            "conditions": [condition],
            "hpaPodSelector": f"{NAME_LABEL}={name},{WORKER_INDEX_LABEL}=0",
            "observedGeneration": meta.get("generation", 1),
        }
        # omitempty int32s: a zero count is not stored (None removes it in a merge patch).
        counts = {"replicas": len(leaders), "readyReplicas": ready, "updatedReplicas": updated}
        stored = {**status, **{k: v for k, v in counts.items() if v}}
        if old != stored:
            patch = {**status, **{k: v or None for k, v in counts.items()}}
            with contextlib.suppress(ApiError):
                self.store.patch(
                    self.store.kinds[KEY], ns, name, "merge", {"status": patch}, "status"
                )
