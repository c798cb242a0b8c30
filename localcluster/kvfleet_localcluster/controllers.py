"""The controllers a cluster would run for us: Deployments → Pods, and a kubelet.

The Deployment controller keeps each Deployment's pods at spec.replicas with its current
template (pods carry `pod-template-hash`); a changed template is rolled pod by pod (a new pod
first, an old one removed once a new one is Ready); scaling down removes pods the way the
ReplicaSet controller chooses: lowest `controller.kubernetes.io/pod-deletion-cost` first,
then not-ready before ready, then the newest. Deployment status reports replicas, ready,
updated and available counts and observedGeneration.

The kubelet (`kubelet.py`) runs each pod on its own loopback IP (127.0.0.2, .3, ...; a second
cluster running at once 127.1.0.2, ...: `addresses.py`): as a local process for the images
it knows, or — in the no-process mode of fast tests — as a pod that becomes Ready after a
delay. Both act on the store directly, as in-cluster controllers
act through the API: each write is a real write that watchers see.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfleet_localcluster.addresses import PodRange
from kvfleet_localcluster.apitypes import ApiError, Kind
from kvfleet_localcluster.events import EventRecorder
from kvfleet_localcluster.kinds import (
    CONFIG_KINDS,
    DEPLOYMENT,
    POD,
    SERVICE,
    STATEFULSET,
    is_ready,
    template_hash,
)
from kvfleet_localcluster.kubelet import (
    ClusterAccess,
    KubeletConfig,
    PodRunner,
    cancel_and_wait,
    log_file,
    log_runs,
    pod_dir,
    service_table_file,
)
from kvfleet_localcluster.leaderworkersets import KEY as LWS_KEY
from kvfleet_localcluster.leaderworkersets import NAME_LABEL as LWS_NAME_LABEL
from kvfleet_localcluster.leaderworkersets import LeaderWorkerSets
from kvfleet_localcluster.services import ServiceTable
from kvfleet_localcluster.statefulsets import reconcile_statefulset
from kvfleet_localcluster.store import Store

log = logging.getLogger("kvfleet.cluster")

HASH_LABEL = "pod-template-hash"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def deletion_order(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Which pods go first when scaling down, as the ReplicaSet controller ranks them
    (`ActivePodsWithRanks`): not ready before ready, then the lower pod-deletion-cost, then
    the newer."""

    def rank(p: dict[str, Any]) -> tuple[int, int, str]:
        cost = int((p["metadata"].get("annotations") or {}).get(DELETION_COST, 0))
        created = p["metadata"].get("creationTimestamp", "")
        return 1 if is_ready(p) else 0, cost, "".join(chr(0x10FFFF - ord(c)) for c in created)

    return sorted(pods, key=rank)


@dataclass
class Cluster:
    """The store's controllers, driven by its events and a periodic resync."""

    store: Store
    kubelet: KubeletConfig = field(default_factory=lambda: KubeletConfig(run_processes=False))
    access: ClusterAccess | None = None
    """The API server as pods reach it (service-account tokens, CA); None: no credentials."""
    _dirty: asyncio.Event = field(default_factory=asyncio.Event)
    _ips: dict[str, str] = field(default_factory=dict)
    _next_ip: int = 1
    """127.0.0.1 is the host; pods get 127.<range>.0.2, .3, ... (`addresses.py`)."""
    _pod_range: PodRange | None = None
    _runners: dict[str, tuple[PodRunner, asyncio.Task[None]]] = field(default_factory=dict)
    _stopping: set[asyncio.Task[None]] = field(default_factory=set)
    _failed: dict[str, str] = field(default_factory=dict)
    """Deployment uid → why its last pod creation failed (its ReplicaFailure condition)."""

    _changed: set[tuple[str, str]] = field(default_factory=set)
    """Deployments (namespace, name) to reconcile: changed, or one of their pods changed."""
    _pods_changed: bool = True

    _statefulsets: set[tuple[str, str]] = field(default_factory=set)
    """StatefulSets (namespace, name) to reconcile."""
    _leader_worker_sets: set[tuple[str, str]] = field(default_factory=set)
    """LeaderWorkerSets (namespace, name) to reconcile (once their CRD is installed)."""
    _lws: LeaderWorkerSets = field(init=False)
    _services: ServiceTable | None = None
    _services_changed: bool = True
    _events: EventRecorder = field(init=False)

    def __post_init__(self) -> None:
        for kind in (POD, DEPLOYMENT, STATEFULSET, SERVICE):
            self.store.kinds.setdefault(kind.key, kind)
        self.store.listeners.append(self._on_event)
        self._events = EventRecorder(self.store)
        self._lws = LeaderWorkerSets(self.store)
        if self.kubelet.run_processes:
            self._services = ServiceTable(service_table_file(self.kubelet))
            self._pod_range = PodRange()  # processes bind their pod's address: claim a range

    def _on_event(self, kind: Kind, event: str, obj: dict[str, Any]) -> None:
        """Only what changed is reconciled: a write to one of 1,000 Deployments (or to one of
        its pods) costs one Deployment's reconcile, not a pass over all of them."""
        meta = obj["metadata"]
        ns = meta.get("namespace", "")
        if kind.key == DEPLOYMENT.key:
            self._changed.add((ns, meta["name"]))
        elif kind.key == STATEFULSET.key:
            self._statefulsets.add((ns, meta["name"]))
        elif kind.key == SERVICE.key:
            self._services_changed = True
        elif kind.key == LWS_KEY:
            self._leader_worker_sets.add((ns, meta["name"]))
        elif kind.key == POD.key:
            self._pods_changed = self._services_changed = True
            if lws := (meta.get("labels") or {}).get(LWS_NAME_LABEL):
                self._leader_worker_sets.add((ns, lws))
            for ref in meta.get("ownerReferences") or []:
                if ref.get("kind") == "Deployment":
                    self._changed.add((ns, ref.get("name", "")))
                elif ref.get("kind") == "StatefulSet":
                    self._statefulsets.add((ns, ref.get("name", "")))
        else:
            return
        self._dirty.set()

    # ---- deployments ----------------------------------------------------------------------
    def _owned_pods(self, dep: dict[str, Any]) -> list[dict[str, Any]]:
        """Its live pods, from the store's owner index (read-only objects, not copies)."""
        return [
            p
            for p in self.store.owned_by(dep["metadata"]["uid"], POD.key)
            if not p["metadata"].get("deletionTimestamp")
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
        meta = dep["metadata"]
        try:
            self.store.create(POD, meta["namespace"], template)
        except ApiError as exc:  # e.g. its ServiceAccount does not exist: retried next pass
            self._failed[meta["uid"]] = exc.message
            log.warning("deployment %s: cannot create a pod: %s", meta["name"], exc.message)
        else:
            self._failed.pop(meta["uid"], None)

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
        conditions = [{"type": "Available", "status": "True" if ready >= want else "False"}]
        failure = self._failed.get(dep["metadata"]["uid"])
        if failure:
            conditions.append(
                {
                    "type": "ReplicaFailure",
                    "status": "True",
                    "reason": "FailedCreate",
                    "message": failure,
                }
            )
        status = {
            "observedGeneration": dep["metadata"]["generation"],
            "replicas": len(pods),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": updated,
            "conditions": conditions,
        }
        if (dep.get("status") or {}) != status:
            self.store.patch(
                DEPLOYMENT, ns, dep["metadata"]["name"], "merge", {"status": status}, "status"
            )

    def _delete_pod(self, ns: str, pod: dict[str, Any]) -> None:
        with contextlib.suppress(ApiError):  # already gone
            self.store.delete(POD, ns, pod["metadata"]["name"])

    # ---- kubelet ------------------------------------------------------------------------
    def pod_ip(self, ns: str, name: str) -> str:
        key = f"{ns}/{name}"
        if key not in self._ips:
            n = self._next_ip
            # Without processes nothing binds: the first range's addresses are only labels.
            self._ips[key] = self._pod_range.address(n) if self._pod_range else PodRange.first(n)
            self._next_ip += 1
        return self._ips[key]

    def _write_status(self, ns: str, name: str, status: dict[str, Any]) -> None:
        with contextlib.suppress(ApiError):  # the pod is gone
            self.store.patch(POD, ns, name, "merge", {"status": status}, "status")

    def _warn(self, pod_meta: dict[str, Any], reason: str, message: str) -> None:
        self._events.warning(pod_meta, reason, message)

    def _read(self, ns: str, kind: str, name: str) -> dict[str, Any] | None:
        spec = CONFIG_KINDS[kind]
        try:
            return self.store.get(self.store.kinds.get(spec.key, spec), ns, name)
        except ApiError:
            return None

    def _sync_pods(self) -> None:
        items = self.store.peek(*POD.key)
        live = {
            f"{p['metadata']['namespace']}/{p['metadata']['name']}": p
            for p in items
            if not p["metadata"].get("deletionTimestamp")
        }
        for key in [k for k in self._runners if k not in live or self._replaced(k, live[k])]:
            runner, task = self._runners.pop(key)
            self._ips.pop(key, None)
            stopping = asyncio.create_task(self._stop_runner(runner, task))
            self._stopping.add(stopping)
            stopping.add_done_callback(self._stopping.discard)
        for key, pod in live.items():
            if key in self._runners:
                continue
            ns, name = key.split("/", 1)
            runner = PodRunner(
                ns,
                name,
                self.pod_ip(ns, name),
                pod.get("spec") or {},
                self.kubelet,
                lambda status, ns=ns, name=name: self._write_status(ns, name, status),
                self._read,
                self.access,
                pod["metadata"],
                lambda reason, message, meta=pod["metadata"]: self._warn(meta, reason, message),
            )
            self._runners[key] = (runner, asyncio.create_task(runner.run()))

    def _replaced(self, key: str, pod: dict[str, Any]) -> bool:
        """A pod deleted and created again under its name (a StatefulSet's) between two
        passes: the old one's process goes, the new one gets its own."""
        return bool(self._runners[key][0].meta.get("uid") != pod["metadata"].get("uid"))

    # ---- container logs (the API server's pods/log) ------------------------------------------
    def runs(self, namespace: str, pod: str, container: str) -> list[Path]:
        return log_runs(pod_dir(self.kubelet, namespace, pod), container)

    def running(self, namespace: str, pod: str, container: str, run: Path) -> bool:
        entry = self._runners.get(f"{namespace}/{pod}")
        if entry is None:
            return False
        runner = entry[0]
        alive = runner.proc is not None and runner.proc.returncode is None
        return alive and run == log_file(runner.pod_dir, container, runner.restarts)

    @staticmethod
    async def _stop_runner(runner: PodRunner, task: asyncio.Task[None]) -> None:
        try:
            await cancel_and_wait(task)
        except Exception:  # a pod's failure must not take the node down
            log.exception("pod %s/%s failed", runner.ns, runner.name)
        await runner.stop()
        runner.cleanup()

    async def stop_pods(self) -> None:
        """Stop every pod process (cluster shutdown): graceful, then forced."""
        runners = list(self._runners.values())
        self._runners.clear()
        await asyncio.gather(*(self._stop_runner(r, t) for r, t in runners), *self._stopping)

    # ---- loop -----------------------------------------------------------------------------
    def reconcile(self, full: bool = True) -> None:
        """Reconcile the Deployments that changed (`full`: all of them), then the pods."""
        if full:
            todo = self.store.peek(*DEPLOYMENT.key)
            self._changed.clear()
        else:
            keys, self._changed = self._changed, set()
            found = (self.store.lookup(DEPLOYMENT.key, ns, name) for ns, name in sorted(keys))
            todo = [d for d in found if d is not None]
        for dep in todo:
            self.reconcile_deployment(dep)
        sets, self._statefulsets = self._statefulsets, set()
        found = (self.store.lookup(STATEFULSET.key, ns, name) for ns, name in sorted(sets))
        for sts in self.store.peek(*STATEFULSET.key) if full else [s for s in found if s]:
            reconcile_statefulset(self.store, sts)
        groups, self._leader_worker_sets = self._leader_worker_sets, set()
        if full:
            todo_lws = self.store.peek(*LWS_KEY) if LWS_KEY in self.store.kinds else []
        else:
            found_lws = (self.store.lookup(LWS_KEY, ns, name) for ns, name in sorted(groups))
            todo_lws = [s for s in found_lws if s]
        for lws in todo_lws:
            self._lws.reconcile(lws)
        if full or self._pods_changed:
            self._pods_changed = False
            self._sync_pods()
        if self._services is not None and (full or self._services_changed):
            self._services_changed = False
            self._services.sync(self.store)

    async def run(self, resync_s: float = 1.0) -> None:
        """Controllers until cancelled; then every pod process is stopped."""
        loop = asyncio.get_running_loop()
        next_full = 0.0
        try:
            while True:
                self._dirty.clear()
                full = loop.time() >= next_full
                if full:
                    next_full = loop.time() + resync_s
                self.reconcile(full)
                # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the event's
                # result when a cancel lands as the event is set, and this loop would go on.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(resync_s):
                        await self._dirty.wait()
        finally:
            await asyncio.shield(self.stop_pods())
            if self._pod_range is not None:
                self._pod_range.release()
