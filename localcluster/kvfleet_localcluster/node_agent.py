"""A node agent: what a kubelet does for a real API server, with pods as local processes.

It registers a Node (capacity: CPU, memory, pods, `nvidia.com/gpu`; the GPU product label
NVIDIA's feature discovery sets) and keeps its Lease renewed, so the real scheduler places
pods on it and the node lifecycle controller sees it alive. It watches the pods the scheduler
bound to it (`spec.nodeName`, a server-side field selector) and runs each with a `PodRunner`
(`kubelet.py`): volumes, the process, probes, restarts, graceful stop. Status goes to the
pods' `status` subresource (`node_pods.StatusWriter`); a deleted pod is stopped (preStop,
SIGTERM, grace) and then removed with grace 0, as a kubelet finishes a graceful deletion.
What pods reference is read with the node's own credentials — the Node authorizer lets a node
read only what its pods use (`node_pods.ReferenceCache`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvfleet_localcluster.apitypes import ApiError
from kvfleet_localcluster.kubeapi import LEASES, NODES, PODS, KubeClient
from kvfleet_localcluster.kubelet import (
    KubeletConfig,
    PodRunner,
    cancel_and_wait,
    log_file,
    log_runs,
    pod_dir,
)
from kvfleet_localcluster.node_events import NodeEvents
from kvfleet_localcluster.node_pods import ReferenceCache, StatusWriter
from kvfleet_localcluster.podspec import ClusterAccess
from kvfleet_localcluster.reflector import Reflector

log = logging.getLogger("kvfleet.node")
Json = dict[str, Any]
LEASE_RENEW_S = 10.0
LEASE_SECONDS = 40
KUBELET_VERSION = "v1.37.2"
"""What the Node reports; the control plane is built at the same release."""
FINISHED = ("Succeeded", "Failed")


@dataclass(frozen=True)
class NodeSpec:
    """One simulated node: its name, what it offers, and its labels."""

    name: str
    gpus: int = 8
    """`nvidia.com/gpu` capacity."""
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    """The `nvidia.com/gpu.product` label (the operator's `gpuType` selects on it)."""
    cpu: str = "64"
    memory: str = "512Gi"
    max_pods: int = 110
    labels: Mapping[str, str] = field(default_factory=dict)

    def node_object(self) -> Json:
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **({"nvidia.com/gpu.product": self.gpu_product} if self.gpus else {}),
            **self.labels,
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": labels},
        }

    def status(self, kubelet_port: int) -> Json:
        resources = {"cpu": self.cpu, "memory": self.memory, "pods": str(self.max_pods)}
        if self.gpus:
            resources["nvidia.com/gpu"] = str(self.gpus)
        stamp = _now()
        kinds = (
            ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID"),
            ("Ready", "True", "KubeletReady"),
        )
        conditions = [
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": "local node agent",
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }
            for kind, status, reason in kinds
        ]
        return {
            "capacity": resources,
            "allocatable": resources,
            "conditions": conditions,
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": self.name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
            "nodeInfo": _node_info(),
        }


def _node_info() -> Json:
    info = dict.fromkeys(
        ("machineID", "systemUUID", "bootID", "kernelVersion", "kubeProxyVersion"), ""
    )
    return {
        **info,
        "kubeletVersion": KUBELET_VERSION,
        "operatingSystem": "linux",
        "architecture": "amd64",
        "containerRuntimeVersion": "kvfleet-processes://1",
        "osImage": "kvfleet local node (pods run as processes)",
    }


def _now(micro: bool = False) -> str:
    stamp = datetime.now(UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def _key(pod: Json) -> str:
    return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"


@dataclass
class NodeAgent:
    """One node's kubelet. `run()` until cancelled; then every pod process is stopped."""

    spec: NodeSpec
    client: KubeClient
    """Logged in as the node (`system:node:<name>`, group `system:nodes`)."""
    kubelet: KubeletConfig
    allocate_ip: Callable[[], str]
    """A fresh pod address (shared by the nodes of one cluster: addresses never repeat)."""
    api_host: str
    api_port: int
    ca_pem: bytes
    kubelet_port: int = 0
    """The kubelet API's port (logs, port-forward) the API server dials; set before `run()`."""
    _runners: dict[str, tuple[PodRunner, asyncio.Task[None]]] = field(default_factory=dict)
    _stopping: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _dirty: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.events = NodeEvents(self.client, self.spec.name)
        self.refs = ReferenceCache(self.client)
        self.status = StatusWriter(self.client)
        selector = {"fieldSelector": f"spec.nodeName={self.spec.name}"}
        self.pods = Reflector(self.client, PODS, self._dirty.set, selector)

    # ---- registration and heartbeat ---------------------------------------------------------
    async def register(self) -> None:
        try:
            await self.client.create(NODES, None, self.spec.node_object())
        except ApiError as exc:
            if exc.code != 409:
                raise
        status = self.spec.status(self.kubelet_port)
        await self.client.patch(NODES, None, self.spec.name, {"status": status}, sub="status")

    async def _renew_lease(self) -> None:
        node = await self.client.get(NODES, None, self.spec.name)
        owner = {
            "apiVersion": "v1",
            "kind": "Node",
            "name": self.spec.name,
            "uid": node["metadata"]["uid"],
        }
        while True:
            spec = {
                "holderIdentity": self.spec.name,
                "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": _now(micro=True),
            }
            lease = {"metadata": {"name": self.spec.name, "ownerReferences": [owner]}, "spec": spec}
            try:
                await self.client.create(LEASES, "kube-node-lease", lease)
            except ApiError as exc:
                if exc.code != 409:
                    log.warning("node %s: lease: %s", self.spec.name, exc.message)
                with contextlib.suppress(ApiError):
                    await self.client.patch(
                        LEASES, "kube-node-lease", self.spec.name, {"spec": spec}
                    )
            await asyncio.sleep(LEASE_RENEW_S)

    # ---- pods --------------------------------------------------------------------------------
    def _runner(self, pod: Json) -> PodRunner:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        ns, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
        return PodRunner(
            ns,
            name,
            self.allocate_ip(),
            spec,
            self.kubelet,
            lambda status: self.status.submit(ns, name, uid, status),
            self.refs.read,
            ClusterAccess(self.api_host, self.api_port, self.ca_pem, self.refs.token),
            meta,
            lambda reason, message: self.events.post(meta, reason, message),
        )

    async def _life(self, pod: Json, runner: PodRunner) -> None:
        """Read what the pod references, then run it; its references stay fresh meanwhile."""
        meta, spec = pod["metadata"], pod.get("spec") or {}
        await self.refs.first_refresh(meta, spec)
        period = max(0.2, 10.0 * self.kubelet.time_scale)
        fresh = asyncio.create_task(self.refs.keep_fresh(meta, spec, period))
        try:
            await runner.run()
        except Exception:
            # Said at once: the task is only awaited when the pod is deleted.
            log.exception("pod %s/%s: its runner failed", runner.ns, runner.name)
            raise
        finally:
            await cancel_and_wait(fresh)

    def _sync(self) -> None:
        pods = self.pods.items
        for key, (runner, task) in list(self._runners.items()):
            pod = pods.get(key)
            meta = pod["metadata"] if pod is not None else {}
            if meta.get("uid") != runner.meta.get("uid"):
                pod = None  # gone, or replaced under its name: the old process goes
            if pod is None or meta.get("deletionTimestamp"):
                del self._runners[key]
                self._stopping[key] = asyncio.create_task(self._stop(runner, task, pod))
        for key, pod in pods.items():
            meta = pod["metadata"]
            if key in self._runners or key in self._stopping:
                continue
            if meta.get("deletionTimestamp"):
                self._stopping[key] = asyncio.create_task(self._finish(pod))
            elif (pod.get("status") or {}).get("phase") not in FINISHED:
                runner = self._runner(pod)
                self._runners[key] = (runner, asyncio.create_task(self._life(pod, runner)))

    async def _stop(
        self, runner: PodRunner, task: asyncio.Task[None], pod: Json | None, pre_stop: bool = True
    ) -> None:
        """Graceful: preStop, SIGTERM, SIGKILL after the grace period; then the pod is gone."""
        try:
            try:
                await cancel_and_wait(task)
            except Exception:  # a pod's failure must not take the node down
                log.exception("pod %s/%s failed", runner.ns, runner.name)
            await runner.stop(pre_stop)
            runner.cleanup()
            self.status.forget(runner.ns, runner.name)
            if pod is not None:
                await self._finish(pod)
        finally:
            self._stopping.pop(f"{runner.ns}/{runner.name}", None)
            self._dirty.set()

    async def _finish(self, pod: Json) -> None:
        """The kubelet's last word on a deleted pod: delete it with grace 0 (uid-checked)."""
        meta = pod["metadata"]
        try:
            await self.client.delete(PODS, meta["namespace"], meta["name"], 0, uid=meta.get("uid"))
        except ApiError as exc:
            if exc.code not in (404, 409):
                log.warning(
                    "pod %s/%s: final delete: %s", meta["namespace"], meta["name"], exc.message
                )
        finally:
            self._stopping.pop(_key(pod), None)

    # ---- container logs (the kubelet API's containerLogs) -------------------------------------
    def runs(self, namespace: str, pod: str, container: str) -> list[Path]:
        return log_runs(pod_dir(self.kubelet, namespace, pod), container)

    def running(self, namespace: str, pod: str, container: str, run: Path) -> bool:
        entry = self._runners.get(f"{namespace}/{pod}")
        if entry is None:
            return False
        runner = entry[0]
        alive = runner.proc is not None and runner.proc.returncode is None
        return alive and run == log_file(runner.pod_dir, container, runner.restarts)

    def pod(self, namespace: str, name: str) -> Json | None:
        return self.pods.items.get(f"{namespace}/{name}")

    # ---- loop ----------------------------------------------------------------------------------
    async def run(self) -> None:
        """Register, then keep the node alive and its pods running, until cancelled."""
        await self.register()
        background = [
            asyncio.create_task(self._renew_lease()),
            asyncio.create_task(self.pods.run()),
            asyncio.create_task(self.status.run()),
        ]
        try:
            while True:
                await self._dirty.wait()
                self._dirty.clear()
                self._sync()
        finally:
            # Whoever stops the node cancels again while it waits (cancel_and_wait): the pods
            # must be stopped before it goes on to close the node's client and release its
            # address range, so further cancels wait for the shutdown too.
            shutdown = asyncio.ensure_future(self._shutdown(background))
            while not shutdown.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(shutdown)

    async def _shutdown(self, background: list[asyncio.Task[Any]]) -> None:
        """The node going away: every pod process stopped, without preStop hooks (a hook
        would only hold the cluster's stop: no one routes to a node that is going), and all
        of them gone before it returns (a process left running would keep its address when
        the next cluster reuses the range)."""
        runners = list(self._runners.values())
        self._runners.clear()
        await asyncio.gather(
            *(self._stop(r, t, None, pre_stop=False) for r, t in runners),
            *self._stopping.values(),
            return_exceptions=True,
        )
        for task in background:
            # One that already failed (its session closed under it) must not leave the
            # others running.
            with contextlib.suppress(Exception):
                await cancel_and_wait(task)
