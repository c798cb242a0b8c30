"""The local cluster's nodes, for a real control plane: one node agent per simulated node
(each with its kubelet API), the volume provisioner, and the Service table pods resolve
names from.

    async with ClusterNodes(access, kubelet, [NodeSpec("gpu-a", gpus=8)]) as nodes:
        ...   # pods the scheduler binds to gpu-a run as processes

The Service table (`services.py`) stands in for cluster DNS and kube-proxy: every Service
→ the addresses of its Ready pods, from watches of all pods and Services, rewritten only
when it changes.
"""

from __future__ import annotations

import asyncio
import itertools
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp.web

from kvfleet_localcluster import kubelet_api
from kvfleet_localcluster.addresses import PodRange
from kvfleet_localcluster.kubeapi import PODS, SERVICES, KubeClient
from kvfleet_localcluster.kubelet import (
    KubeletConfig,
    cancel_and_wait,
    node_dir,
    service_table_file,
)
from kvfleet_localcluster.node_agent import NodeAgent, NodeSpec
from kvfleet_localcluster.provisioner import Provisioner
from kvfleet_localcluster.reflector import Reflector
from kvfleet_localcluster.services import ServiceTable, table_of

DEFAULT_NODES = (
    *(NodeSpec(f"h100-{n}", gpus=8, gpu_product="NVIDIA-H100-80GB-HBM3") for n in range(1, 7)),
    NodeSpec("h200-1", gpus=8, gpu_product="NVIDIA-H200"),
    NodeSpec("a100-1", gpus=8, gpu_product="NVIDIA-A100-SXM4-80GB"),
    NodeSpec("l40s-1", gpus=8, gpu_product="NVIDIA-L40S"),
)
"""Enough of each GPU the examples name for all of them at once (`kubectl apply -f
examples/`): the DeepSeek-V3 pair alone takes two H100 nodes, the disaggregated 70B twelve
H100s. Nodes cost a Lease renewal every 10 s each; pods, not nodes, run processes."""


@dataclass(frozen=True)
class ApiAccess:
    """How the node side reaches the API server."""

    host: str
    port: int
    ca_pem: bytes
    admin_token: str
    node_certificate: Callable[[str], tuple[Path, Path]]
    """Node name → its client certificate and key files: user `system:node:<name>`, group
    `system:nodes`, which the Node authorizer and NodeRestriction admission know."""

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"


class ServiceDirectory:
    """Watches of all pods and Services → the node's Service table file."""

    def __init__(self, client: KubeClient, path: Path) -> None:
        self._table = ServiceTable(path)
        self._pods = Reflector(client, PODS, self._write)
        self._services = Reflector(client, SERVICES, self._write)

    def _write(self) -> None:
        if self._pods.synced.is_set() and self._services.synced.is_set():
            self._table.write(table_of(self._pods.items.values(), self._services.items.values()))

    async def run(self) -> None:
        await asyncio.gather(self._pods.run(), self._services.run())


class ClusterNodes:
    def __init__(
        self,
        access: ApiAccess,
        kubelet: KubeletConfig,
        nodes: tuple[NodeSpec, ...] = DEFAULT_NODES,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        assert kubelet.state_dir is not None, "the nodes need a state directory"
        self.access, self.kubelet, self.specs, self._tls = access, kubelet, nodes, tls
        self._range = PodRange() if kubelet.run_processes else None
        self._count = itertools.count(1)
        self._clients: list[KubeClient] = []
        self._runners: list[aiohttp.web.AppRunner] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self.agents: dict[str, NodeAgent] = {}

    def _allocate_ip(self) -> str:
        n = next(self._count)
        return self._range.address(n) if self._range else PodRange.first(n)

    def _client(
        self, agent: str, token: str | None = None, cert: tuple[Path, Path] | None = None
    ) -> KubeClient:
        client = KubeClient(self.access.url, self.access.ca_pem, agent, token, cert)
        self._clients.append(client)
        return client

    async def __aenter__(self) -> ClusterNodes:
        try:
            await self._start()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _start(self) -> None:
        admin = self._client("kvfleet-local-cluster", token=self.access.admin_token)
        state = node_dir(self.kubelet)
        self._tasks.append(asyncio.create_task(Provisioner(admin, state / "volumes").run()))
        if self.kubelet.run_processes:
            directory = ServiceDirectory(admin, service_table_file(self.kubelet))
            self._tasks.append(asyncio.create_task(directory.run()))
        for spec in self.specs:
            cert = self.access.node_certificate(spec.name)
            client = self._client(f"kubelet/{spec.name}", cert=cert)
            agent = NodeAgent(
                spec, client, self.kubelet, self._allocate_ip,
                self.access.host, self.access.port, self.access.ca_pem,
            )  # fmt: skip
            if self._tls is not None:
                runner, agent.kubelet_port = await kubelet_api.serve(agent, "127.0.0.1", self._tls)
                self._runners.append(runner)
            await agent.register()
            self.agents[spec.name] = agent
            self._tasks.append(asyncio.create_task(agent.run()))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for task in reversed(self._tasks):  # node agents first: they stop their pods
            await cancel_and_wait(task)
        for runner in self._runners:
            await runner.cleanup()
        for client in self._clients:
            await client.close()
        if self._range is not None:
            self._range.release()
