"""The controllers a cluster would run for us: Deployments → Pods, and a kubelet.

The Deployment controller keeps each Deployment's pods at spec.replicas with its current
template (pods carry `pod-template-hash`); a changed template is rolled pod by pod (a new pod
first, an old one removed once a new one is Ready); scaling down removes pods the way the
ReplicaSet controller chooses: lowest `controller.kubernetes.io/pod-deletion-cost` first,
then not-ready before ready, then the newest. Deployment status reports replicas, ready,
updated and available counts and observedGeneration.

The kubelet here is the no-process mode: a pod becomes Running and Ready after a delay, with
its own loopback IP (127.0.0.2, .3, ...), so every pod listens on the port its manifest says.
Both act on the store directly, as in-cluster controllers act through the API: each write is
a real write that watchers see.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvfleet_sim.cluster.store import ApiError, Kind, Store

log = logging.getLogger("kvfleet.cluster")

POD = Kind("", "v1", "pods", "Pod", True, frozenset({"status"}))
DEPLOYMENT = Kind(
    "apps",
    "v1",
    "deployments",
    "Deployment",
    True,
    frozenset({"status", "scale"}),
    selector_path="spec.selector",
)
HASH_LABEL = "pod-template-hash"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def is_ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def deletion_order(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Which pods go first when scaling down (as the ReplicaSet controller ranks them)."""

    def rank(p: dict[str, Any]) -> tuple[int, int, str]:
        cost = int((p["metadata"].get("annotations") or {}).get(DELETION_COST, 0))
        created = p["metadata"].get("creationTimestamp", "")
        return cost, 1 if is_ready(p) else 0, "".join(chr(0x10FFFF - ord(c)) for c in created)

    return sorted(pods, key=rank)


@dataclass
class Cluster:
    """The store's controllers, driven by its events and a periodic resync."""

    store: Store
    ready_delay_s: float = 0.2
    """No-process kubelet: how long a pod takes to become Ready."""
    _dirty: asyncio.Event = field(default_factory=asyncio.Event)
    _ips: dict[str, str] = field(default_factory=dict)
    _next_ip: int = 2
    _pending: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.store.kinds.setdefault(POD.key, POD)
        self.store.kinds.setdefault(DEPLOYMENT.key, DEPLOYMENT)
        self.store.listeners.append(lambda kind, event, obj: self._dirty.set())

    # ---- deployments ----------------------------------------------------------------------
    def _owned_pods(self, dep: dict[str, Any]) -> list[dict[str, Any]]:
        uid = dep["metadata"]["uid"]
        items, _ = self.store.list_objects(POD, dep["metadata"]["namespace"])
        return [
            p
            for p in items
            if any(r.get("uid") == uid for r in p["metadata"].get("ownerReferences") or [])
            and not p["metadata"].get("deletionTimestamp")
        ]

    def _new_pod(self, dep: dict[str, Any], thash: str) -> None:
        template = copy.deepcopy(dep["spec"].get("template") or {})
        meta = template.setdefault("metadata", {})
        meta["labels"] = {**(meta.get("labels") or {}), HASH_LABEL: thash}
        meta["generateName"] = f"{dep['metadata']['name']}-{thash[:5]}-"
        meta["ownerReferences"] = [
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": dep["metadata"]["name"],
                "uid": dep["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        template.pop("status", None)
        self.store.create(POD, dep["metadata"]["namespace"], template)

    def reconcile_deployment(self, dep: dict[str, Any]) -> None:
        ns, spec = dep["metadata"]["namespace"], dep.get("spec") or {}
        want = int(spec.get("replicas", 1))
        thash = template_hash(spec.get("template") or {})
        pods = self._owned_pods(dep)
        current = [p for p in pods if p["metadata"]["labels"].get(HASH_LABEL) == thash]
        old = [p for p in pods if p not in current]
        ready_new = sum(1 for p in current if is_ready(p))
        # Roll: keep one extra new pod while old ones remain (maxSurge 1, maxUnavailable 0).
        target_new = want if not old else min(want, ready_new + 1)
        for _ in range(max(0, target_new - len(current))):
            self._new_pod(dep, thash)
        if old:
            surplus = len(old) + ready_new - want
            for p in deletion_order(old)[: max(0, surplus)]:
                self._delete_pod(ns, p)
        elif len(current) > want:
            for p in deletion_order(current)[: len(current) - want]:
                self._delete_pod(ns, p)
        pods = self._owned_pods(dep)
        ready = sum(1 for p in pods if is_ready(p))
        updated = sum(1 for p in pods if p["metadata"]["labels"].get(HASH_LABEL) == thash)
        status = {
            "observedGeneration": dep["metadata"]["generation"],
            "replicas": len(pods),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": updated,
            "conditions": [{"type": "Available", "status": "True" if ready >= want else "False"}],
        }
        if (dep.get("status") or {}) != status:
            self.store.patch(
                DEPLOYMENT, ns, dep["metadata"]["name"], "merge", {"status": status}, "status"
            )

    def _delete_pod(self, ns: str, pod: dict[str, Any]) -> None:
        with contextlib.suppress(ApiError):  # already gone
            self.store.delete(POD, ns, pod["metadata"]["name"])

    # ---- kubelet (no processes) -----------------------------------------------------------
    def pod_ip(self, ns: str, name: str) -> str:
        key = f"{ns}/{name}"
        if key not in self._ips:
            self._ips[key] = f"127.0.0.{self._next_ip}"
            self._next_ip += 1
        return self._ips[key]

    async def _start_pod(self, ns: str, name: str) -> None:
        await asyncio.sleep(self.ready_delay_s)
        self._pending.discard(f"{ns}/{name}")
        try:
            pod = self.store.get(POD, ns, name)
        except ApiError:
            return
        containers = (pod.get("spec") or {}).get("containers") or []
        status = {
            "phase": "Running",
            "podIP": self.pod_ip(ns, name),
            "hostIP": "127.0.0.1",
            "conditions": [
                {"type": "Ready", "status": "True"},
                {"type": "ContainersReady", "status": "True"},
            ],
            "containerStatuses": [
                {"name": c.get("name"), "ready": True, "restartCount": 0, "state": {"running": {}}}
                for c in containers
            ],
        }
        self.store.patch(POD, ns, name, "merge", {"status": status}, "status")

    def _pods_to_start(self) -> Iterator[tuple[str, str]]:
        items, _ = self.store.list_objects(POD, None)
        for p in items:
            meta = p["metadata"]
            key = f"{meta['namespace']}/{meta['name']}"
            if not p.get("status") and key not in self._pending:
                self._pending.add(key)
                yield meta["namespace"], meta["name"]

    # ---- loop -----------------------------------------------------------------------------
    def reconcile(self) -> list[tuple[str, str]]:
        deployments, _ = self.store.list_objects(DEPLOYMENT, None)
        for dep in deployments:
            self.reconcile_deployment(dep)
        return list(self._pods_to_start())

    async def run(self, resync_s: float = 1.0) -> None:
        starting: set[asyncio.Task[None]] = set()
        while True:
            self._dirty.clear()
            for ns, name in self.reconcile():
                task = asyncio.create_task(self._start_pod(ns, name))
                starting.add(task)
                task.add_done_callback(starting.discard)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), timeout=resync_s)
