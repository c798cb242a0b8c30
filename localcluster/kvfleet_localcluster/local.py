"""The local cluster as one unit: API server, controllers, kubelet, kubeconfig.

    async with LocalCluster(LocalClusterConfig(...)) as cluster:
        print(cluster.url)            # kubectl --kubeconfig cluster.kubeconfig ...

One implementation serves the tests, the demo and `kvfleet cluster up`. Leaving the block
stops every pod process (SIGTERM, then SIGKILL) before the API server goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType

import kmock
import yaml

from kvfleet_localcluster.apiserver import ClusterAPI
from kvfleet_localcluster.controllers import Cluster
from kvfleet_localcluster.kubelet import KubeletConfig


@dataclass(frozen=True)
class LocalClusterConfig:
    kubeconfig: Path
    """Written on start: a context `kvfleet-local` pointing at the API server."""
    host: str = "127.0.0.1"
    port: int | None = None
    """API server port; None: a free one."""
    namespace: str = "default"
    """The kubeconfig context's namespace."""
    crds_dir: Path | None = None
    """CRDs (YAML) to apply at start, e.g. the repository's `crds/`."""
    kubelet: KubeletConfig = field(default_factory=KubeletConfig)
    resync_s: float = 1.0
    """Controllers' periodic resync (they also react to every change at once)."""
    controllers: bool = True
    """False: the API server alone (no Deployment controller, no kubelet), for tests of the
    API server's own semantics."""


def kubeconfig_document(url: str, namespace: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "kvfleet-local",
        "clusters": [{"name": "kvfleet-local", "cluster": {"server": url}}],
        "contexts": [
            {
                "name": "kvfleet-local",
                "context": {"cluster": "kvfleet-local", "user": "admin", "namespace": namespace},
            }
        ],
        # The emulated API server does not authenticate; clients still want a user.
        "users": [{"name": "admin", "user": {"token": "kvfleet-local"}}],
    }


class LocalCluster:
    def __init__(self, config: LocalClusterConfig) -> None:
        self.config = config
        self.api = ClusterAPI()
        self._server: kmock.Server | None = None
        self._controllers: asyncio.Task[None] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.cluster: Cluster | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        return str(self._server.url).rstrip("/")

    @property
    def kubeconfig(self) -> Path:
        return self.config.kubeconfig

    async def __aenter__(self) -> LocalCluster:
        cfg = self.config
        await self.api.__aenter__()
        self._server = kmock.Server(self.api, host=cfg.host, port=cfg.port)
        await self._server.__aenter__()
        self.api.load_resources()
        if cfg.crds_dir is not None:
            self.api.load_crds(cfg.crds_dir)
        cfg.kubeconfig.parent.mkdir(parents=True, exist_ok=True)
        cfg.kubeconfig.write_text(
            yaml.safe_dump(kubeconfig_document(self.url, cfg.namespace), sort_keys=False)
        )
        kubelet = replace(cfg.kubelet, kubeconfig=cfg.kubelet.kubeconfig or cfg.kubeconfig)
        if kubelet.state_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvfleet-cluster-")
            kubelet = replace(kubelet, state_dir=Path(self._tmp.name))
        if cfg.controllers:
            self.cluster = Cluster(self.api.store, kubelet)
            self._controllers = asyncio.create_task(self.cluster.run(resync_s=cfg.resync_s))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.api.close_watches()  # clients' open watches would hold the server open
        if self._controllers is not None:
            self._controllers.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._controllers
        if self._server is not None:
            await self._server.__aexit__(exc_type, exc, tb)
        await self.api.__aexit__(exc_type, exc, tb)
        if self._tmp is not None:
            self._tmp.cleanup()
