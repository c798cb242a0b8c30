"""The emulated API server, for the tests not yet moved onto the real control plane."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet_localcluster.emulated import EmulatedCluster, EmulatedClusterConfig
from kvfleet_localcluster.kubelet import KubeletConfig
from kvfleet_operator.kube import Kube
from kvfleet_operator.login import Credentials
from kvfleet_operator.scaling.autoscaler import AutoscalerConfig
from tests.support.cluster import OperatorThread
from tests.support.objects import ROOT


def emulated_cluster_config(
    tmp: Path, controllers: bool = True, crds: bool = True, **kubelet: Any
) -> EmulatedClusterConfig:
    """The emulated cluster of a test: `crds/` applied, namespace `ai` in its kubeconfig,
    pods Ready after 50 ms without processes (override with `run_processes=True`)."""
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


@contextlib.asynccontextmanager
async def emulated_cluster_with_operator(
    tmp: Path, autoscaler: AutoscalerConfig | None = None
) -> AsyncIterator[EmulatedCluster]:
    """Pods as processes, and the real operator logged in with the cluster's kubeconfig."""
    config = emulated_cluster_config(tmp, run_processes=True, time_scale=0.05)
    async with EmulatedCluster(config) as local:
        credentials = Credentials(kubeconfig=str(local.kubeconfig))
        operator = OperatorThread(credentials, resync_s=1.0, autoscaler=autoscaler)
        try:
            assert await asyncio.to_thread(operator.ready.wait, 10), "the operator did not start"
            yield local
        finally:
            await asyncio.to_thread(operator.close)


@pytest.fixture
async def emulated_operator_cluster(tmp_path: Path) -> AsyncIterator[EmulatedCluster]:
    """An emulated cluster whose pods run as processes, with the real operator logged in."""
    async with emulated_cluster_with_operator(tmp_path) as local:
        yield local


@dataclasses.dataclass
class EmulatedEnv:
    """An emulated cluster and a client logged in with its kubeconfig."""

    cluster: EmulatedCluster
    kube: Kube

    @property
    def credentials(self) -> Credentials:
        return Credentials(kubeconfig=str(self.cluster.kubeconfig))
