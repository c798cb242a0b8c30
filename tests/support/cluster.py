"""The local cluster and the real operator, as tests use them.

Every cluster runs the real control plane (built from its Go modules; a test is skipped
without Go here, and fails in CI). Each test worker shares one cluster of each kind between
its tests (`shared_cluster.py`): `local_cluster` gives a test a namespace of its own on the
cluster whose pods turn Ready without processes, `process_cluster` one on the cluster whose
pods run as processes. The operator under test watches only its test's namespace, so tests
on one control plane never see each other's objects. A test that changes cluster-scoped
things (CRDs, a cluster-wide operator) starts a cluster of its own (`cluster_config`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet_localcluster.controlplane_build import ensure_built
from kvfleet_localcluster.kubelet import KubeletConfig
from kvfleet_localcluster.local import LocalCluster, LocalClusterConfig
from kvfleet_operator.handlers import Controller, OperatorConfig, run
from kvfleet_operator.kube import POD, Kube
from kvfleet_operator.login import Credentials, api_client
from kvfleet_operator.scaling.autoscaler import AutoscalerConfig
from tests.conftest import require_binary
from tests.support.objects import ROOT
from tests.support.shared_cluster import AuditLog, ClusterThread, WorkerClusters

TEST_AGENT = "kvfleet-test"
"""User agent of the tests' own client: its requests are not the operator's."""
AUDIT_LOG = "audit.log"


@functools.cache
def require_control_plane() -> None:
    """The real control plane is built from its Go modules: without Go a test is skipped
    here (and fails in CI, where .ci/run builds it first); a no-op once built."""
    require_binary("go")
    ensure_built(progress=False)


def cluster_config(
    tmp: Path,
    crds: bool = True,
    nodes: bool = True,
    lws: bool = False,
    namespace: str = "ai",
    monitoring: bool = False,
    **kubelet: Any,
) -> LocalClusterConfig:
    """A local cluster of a test: `crds/` applied unless `crds` is False, `namespace` in its
    kubeconfig, the default nodes (`nodes` False: none, pods stay Pending) whose pods turn
    Ready after 50 ms without processes unless `run_processes=True`, the API server's audit
    log in `tmp/audit.log`. No Prometheus Operator CRDs unless `monitoring`, no
    LeaderWorkerSet unless `lws`."""
    require_control_plane()
    return LocalClusterConfig(
        kubeconfig=tmp / "kubeconfig",
        crds_dir=ROOT / "crds" if crds else None,
        monitoring_crds=monitoring,
        lws=lws,
        namespace=namespace,
        controllers=nodes,
        audit_log=tmp / AUDIT_LOG,
        kubelet=KubeletConfig(
            **{"run_processes": False, "ready_delay_s": 0.05, "state_dir": tmp / "state", **kubelet}
        ),
    )


SHARED_KINDS: dict[str, Callable[[Path], LocalClusterConfig]] = {
    "ready": lambda tmp: cluster_config(tmp, namespace="default"),
    "processes": lambda tmp: cluster_config(
        tmp, namespace="default", run_processes=True, time_scale=0.05
    ),
}


@pytest.fixture(scope="session")
def worker_clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerClusters]:
    """This worker's shared clusters, each started by the first test that asks for it."""
    clusters = WorkerClusters(tmp_path_factory.mktemp("shared-clusters"), SHARED_KINDS)
    yield clusters
    clusters.close()


@dataclasses.dataclass
class Env:
    """A test's namespace on a shared cluster."""

    shared: ClusterThread
    ns: str
    kubeconfig: Path
    """The admin's kubeconfig, its context's namespace `ns`."""
    kube: Kube
    """The test's own client, logged in with that kubeconfig."""

    @property
    def cluster(self) -> LocalCluster:
        return self.shared.cluster

    @property
    def credentials(self) -> Credentials:
        return Credentials(kubeconfig=str(self.kubeconfig))

    def audit(self) -> AuditLog:
        """The API server's audit log from now on."""
        return AuditLog(self.kubeconfig.parent.parent / AUDIT_LOG)


@contextlib.asynccontextmanager
async def namespace_env(
    clusters: WorkerClusters, kind: str, request: pytest.FixtureRequest
) -> AsyncIterator[Env]:
    shared = await asyncio.to_thread(clusters.get, kind)
    ns = await asyncio.to_thread(shared.create_namespace, request.node.name)
    kubeconfig = shared.namespace_kubeconfig(ns)
    client = api_client(Credentials(kubeconfig=str(kubeconfig)))
    client.user_agent = TEST_AGENT
    try:
        yield Env(shared, ns, kubeconfig, Kube(client, field_manager="kvfleet-tests"))
    finally:
        await asyncio.to_thread(shared.delete_namespace, ns)


@pytest.fixture
async def local_cluster(
    worker_clusters: WorkerClusters, request: pytest.FixtureRequest
) -> AsyncIterator[Env]:
    """A namespace of this test's own on the worker's cluster whose pods turn Ready (after
    50 ms) without processes."""
    async with namespace_env(worker_clusters, "ready", request) as env:
        yield env


@pytest.fixture
async def process_cluster(
    worker_clusters: WorkerClusters, request: pytest.FixtureRequest
) -> AsyncIterator[Env]:
    """A namespace of this test's own on the worker's cluster whose pods run as processes
    (probes, restarts and grace periods at 0.05 of a real kubelet's timing)."""
    async with namespace_env(worker_clusters, "processes", request) as env:
        yield env


class OperatorThread:
    """The real operator (`handlers.run`) in its own thread and event loop, logged in with
    the given credentials, watching `namespaces` (empty: the whole cluster); `close()`
    stops it."""

    def __init__(
        self,
        credentials: Credentials,
        resync_s: float = 30.0,
        autoscaler: AutoscalerConfig | None = None,
        liveness_endpoint: str | None = None,
        stall_s: float = OperatorConfig.stall_s,
        namespaces: tuple[str, ...] = (),
    ) -> None:
        config = OperatorConfig(
            credentials=credentials,
            resync_s=resync_s,
            autoscaler=autoscaler or AutoscalerConfig(),
            liveness_endpoint=liveness_endpoint,
            stall_s=stall_s,
            namespaces=namespaces,
        )
        self.kube = Kube(api_client(credentials))
        self.controller = Controller(self.kube, config)
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.outcomes: list[tuple[str, Any]] = []
        self.controller.on_outcome = lambda key, o: self.outcomes.append((key, o))
        self.thread = threading.Thread(
            target=run,
            args=(self.controller,),
            kwargs={"stop_flag": self.stop, "ready_flag": self.ready},
            daemon=True,
        )
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "the operator did not stop"


async def start_operator(env: Env, **kw: Any) -> OperatorThread:
    """The operator, watching `env`'s namespace only, once kopf's watches are up."""
    op = OperatorThread(env.credentials, namespaces=(env.ns,), **kw)
    assert await asyncio.to_thread(op.ready.wait, 10), "the operator did not start"
    return op


OperatorFactory = Callable[[], Awaitable[OperatorThread]]


@pytest.fixture
async def operator_factory(local_cluster: Env) -> AsyncIterator[OperatorFactory]:
    """Start operators on `local_cluster`'s namespace; all are stopped at teardown."""
    started: list[OperatorThread] = []

    async def start() -> OperatorThread:
        op = await start_operator(local_cluster)
        started.append(op)
        return op

    yield start
    for op in started:
        await asyncio.to_thread(op.close)


@contextlib.asynccontextmanager
async def operator_on(
    env: Env, autoscaler: AutoscalerConfig | None = None
) -> AsyncIterator[OperatorThread]:
    """The real operator on `env`'s namespace (resync every second) while inside."""
    op = await start_operator(env, resync_s=1.0, autoscaler=autoscaler)
    try:
        yield op
    finally:
        await asyncio.to_thread(op.close)


@pytest.fixture
async def operator_cluster(process_cluster: Env) -> AsyncIterator[Env]:
    """A namespace whose pods run as processes, with the real operator watching it."""
    async with operator_on(process_cluster):
        yield process_cluster


NO_NODE_GATE = "kvfleet.dev/test-no-node"
"""The scheduling gate of a test's pods that no node agent may run."""


async def write_pod_status(env: Env, name: str, status: dict[str, Any]) -> None:
    """Write a pod's status through `/status`, as its kubelet would."""
    await asyncio.to_thread(env.kube.patch, POD, env.ns, name, {"status": status}, "status")


async def create_pod_no_node_runs(env: Env, pod: dict[str, Any]) -> None:
    """`pod` in `env`'s namespace with the status it carries, written as a kubelet would. A
    real API server keeps no status from a create, and a pod a node runs gets the node's: so
    the pod is created scheduling-gated (no node ever runs it), then its status written."""
    pod = {**pod, "metadata": {**pod["metadata"], "namespace": env.ns}}
    status = pod.pop("status", None)
    pod["spec"] = {**pod["spec"], "schedulingGates": [{"name": NO_NODE_GATE}]}
    await asyncio.to_thread(env.kube.create, pod)
    if status is not None:
        await write_pod_status(env, pod["metadata"]["name"], status)
