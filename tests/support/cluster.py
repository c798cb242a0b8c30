"""The local cluster and the real operator, as tests use them.

`local_cluster` is the stand-in's own `EmulatedCluster` (the one `kvfleet cluster up` runs), with
the CRDs of `crds/` and no pod processes (pods turn Ready after a short delay); it writes a
kubeconfig, and the operator logs in with it exactly as a user's would (`Credentials`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from kvfleet_localcluster.controlplane_build import ensure_built
from kvfleet_localcluster.emulated import EmulatedCluster, EmulatedClusterConfig
from kvfleet_localcluster.kubelet import KubeletConfig
from kvfleet_localcluster.local import LocalClusterConfig
from kvfleet_operator.handlers import Controller, OperatorConfig, run
from kvfleet_operator.kube import Kube
from kvfleet_operator.login import Credentials, api_client
from kvfleet_operator.scaling.autoscaler import AutoscalerConfig
from tests.conftest import require_binary
from tests.support.objects import ROOT

TEST_AGENT = "kvfleet-test"


@functools.cache
def require_control_plane() -> None:
    """The real control plane is built from its Go modules: without Go a test is skipped
    here (and fails in CI, where .ci/run builds it first); a no-op once built."""
    require_binary("go")
    ensure_built(progress=False)


"""User agent of the tests' own client: its requests are not the operator's."""


def cluster_config(
    tmp: Path, controllers: bool = True, crds: bool = True, **kubelet: Any
) -> EmulatedClusterConfig:
    """The local cluster of a test: `crds/` applied, namespace `ai` in its kubeconfig, pods
    Ready after 50 ms without processes (override with `run_processes=True`); `controllers`
    False: the API server alone; `crds` False: no CRD installed. No Prometheus Operator
    (its CRDs): a test that wants PodMonitors installs them as a user would."""
    return EmulatedClusterConfig(
        kubeconfig=tmp / "kubeconfig",
        crds_dir=ROOT / "crds" if crds else None,
        monitoring_crds=False,
        namespace="ai",
        resync_s=0.2,
        controllers=controllers,
        kubelet=KubeletConfig(
            **{"run_processes": False, "ready_delay_s": 0.05, "state_dir": tmp / "state", **kubelet}
        ),
    )


def real_cluster_config(
    tmp: Path, crds: bool = True, nodes: bool = True, lws: bool = False, **kubelet: Any
) -> LocalClusterConfig:
    """The local cluster on the real control plane (built from its Go modules; skipped without
    Go here, a failure in CI): `crds/` applied unless `crds` is False, namespace `ai` in its
    kubeconfig, one node agent (`nodes` False: none, pods stay Pending) whose pods turn Ready
    after 50 ms without processes unless `run_processes=True`."""
    require_control_plane()
    return LocalClusterConfig(
        kubeconfig=tmp / "kubeconfig",
        crds_dir=ROOT / "crds" if crds else None,
        monitoring_crds=False,
        lws=lws,
        namespace="ai",
        controllers=nodes,
        kubelet=KubeletConfig(
            **{"run_processes": False, "ready_delay_s": 0.05, "state_dir": tmp / "state", **kubelet}
        ),
    )


@dataclasses.dataclass
class Env:
    cluster: EmulatedCluster
    kube: Kube
    """The test's own client, logged in with the cluster's kubeconfig."""

    @property
    def api(self) -> Any:
        return self.cluster.api

    @property
    def credentials(self) -> Credentials:
        return Credentials(kubeconfig=str(self.cluster.kubeconfig))


@pytest.fixture
async def local_cluster(tmp_path: Path) -> AsyncIterator[Env]:
    async with EmulatedCluster(cluster_config(tmp_path)) as cluster:
        client = api_client(Credentials(kubeconfig=str(cluster.kubeconfig)))
        client.user_agent = TEST_AGENT
        yield Env(cluster, Kube(client, field_manager="kvfleet-tests"))


class OperatorThread:
    """The real operator (`handlers.run`) in its own thread and event loop, logged in with
    the given credentials; `close()` stops it."""

    def __init__(
        self,
        credentials: Credentials,
        resync_s: float = 30.0,
        autoscaler: AutoscalerConfig | None = None,
        liveness_endpoint: str | None = None,
        stall_s: float = OperatorConfig.stall_s,
    ) -> None:
        config = OperatorConfig(
            credentials=credentials,
            resync_s=resync_s,
            autoscaler=autoscaler or AutoscalerConfig(),
            liveness_endpoint=liveness_endpoint,
            stall_s=stall_s,
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


OperatorFactory = Callable[[], Awaitable[OperatorThread]]


@pytest.fixture
async def operator_factory(local_cluster: Env) -> AsyncIterator[OperatorFactory]:
    """Start operators against `local_cluster`; all are stopped at teardown (the API server
    runs in this loop: wait for the operator's thread without blocking it)."""
    started: list[OperatorThread] = []

    async def start() -> OperatorThread:
        op = OperatorThread(local_cluster.credentials)
        started.append(op)
        assert await asyncio.to_thread(op.ready.wait, 10), "the operator did not start"
        return op

    yield start
    for op in started:
        await asyncio.to_thread(op.close)


@contextlib.asynccontextmanager
async def cluster_with_operator(
    tmp: Path, autoscaler: AutoscalerConfig | None = None
) -> AsyncIterator[EmulatedCluster]:
    """Pods as processes, and the real operator logged in with the cluster's kubeconfig."""
    config = cluster_config(tmp, run_processes=True, time_scale=0.05)
    async with EmulatedCluster(config) as local:
        credentials = Credentials(kubeconfig=str(local.kubeconfig))
        operator = OperatorThread(credentials, resync_s=1.0, autoscaler=autoscaler)
        try:
            assert await asyncio.to_thread(operator.ready.wait, 10), "the operator did not start"
            yield local
        finally:
            await asyncio.to_thread(operator.close)
