"""The emulated cluster, being retired: an API server this project wrote, its controllers and
kubelet in one process. `local.py`'s `LocalCluster` (the real control plane built from its Go
modules, with node agents) replaces it; what still runs here (the tests not yet moved) moves
over and this module goes.

    async with EmulatedCluster(EmulatedClusterConfig(...)) as cluster:
        print(cluster.url)            # kubectl --kubeconfig cluster.kubeconfig ...
 The API server
serves HTTPS only, with a CA made at start; the kubeconfig carries that CA and an admin
token (group system:masters), and pods get service-account tokens — so every client logs in
as it would on a real cluster. Leaving the block stops every pod process (SIGTERM, then
SIGKILL) before the API server goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType

import aiohttp
import aiohttp.web
import yaml

from kvfleet_localcluster import kubeconfigs, pki
from kvfleet_localcluster.apiserver import ClusterAPI
from kvfleet_localcluster.auth import AUTHENTICATED, MASTERS, User
from kvfleet_localcluster.controllers import Cluster
from kvfleet_localcluster.files import replace_file
from kvfleet_localcluster.kubelet import ClusterAccess, KubeletConfig
from kvfleet_localcluster.podmonitors import monitoring_crds

ADMIN = User("kvfleet-admin", (MASTERS, AUTHENTICATED))


@dataclass(frozen=True)
class EmulatedClusterConfig:
    kubeconfig: Path
    """Written on start: a context `kvfleet-local` pointing at the API server."""
    host: str = "127.0.0.1"
    port: int | None = None
    """API server port; None: a free one."""
    namespace: str = "default"
    """The kubeconfig context's namespace."""
    crds_dir: Path | None = None
    """CRDs (YAML) to apply at start, e.g. the repository's `crds/`."""
    monitoring_crds: bool = True
    """Serve the Prometheus Operator's PodMonitor and PrometheusRule CRDs from the start, as a
    cluster with the Prometheus Operator does (`kubectl apply -k manifests/monitoring/` then
    applies); False: a cluster without it (the operator then renders no PodMonitor)."""
    kubelet: KubeletConfig = field(default_factory=KubeletConfig)
    resync_s: float = 1.0
    """Controllers' periodic resync (they also react to every change at once)."""
    controllers: bool = True
    """False: the API server alone (no Deployment controller, no kubelet), for tests of the
    API server's own semantics."""

    def __post_init__(self) -> None:
        # Pods and kubectl read the kubeconfig from other working directories.
        object.__setattr__(self, "kubeconfig", self.kubeconfig.resolve())
        if self.crds_dir is not None:
            object.__setattr__(self, "crds_dir", self.crds_dir.resolve())


def kubeconfig_document(url: str, namespace: str, ca_pem: bytes, token: str) -> dict[str, object]:
    return kubeconfigs.document(url, namespace, ca_pem, kubeconfigs.token_user(token))


class EmulatedCluster:
    def __init__(self, config: EmulatedClusterConfig) -> None:
        self.config = config
        self.api = ClusterAPI()
        self.pki = pki.issue([config.host, "127.0.0.1", "localhost"])
        self.admin_token = self.api.authn.add_user(ADMIN)
        self._runner: aiohttp.web.ServerRunner | None = None
        self._port: int | None = None
        self._controllers: asyncio.Task[None] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.cluster: Cluster | None = None

    @property
    def url(self) -> str:
        assert self._port is not None, "not started"
        return f"https://{self.config.host}:{self._port}"

    def session(self, token: str | None = None) -> aiohttp.ClientSession:
        """An HTTP client that trusts the cluster CA and sends `token` (default: the admin's),
        for code that speaks to the API server without a Kubernetes client."""
        return aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {token or self.admin_token}"},
            connector=aiohttp.TCPConnector(ssl=self.pki.client_context()),
        )

    @property
    def kubeconfig(self) -> Path:
        return self.config.kubeconfig

    async def __aenter__(self) -> EmulatedCluster:
        cfg = self.config
        await self.api.__aenter__()
        kubelet = cfg.kubelet
        if kubelet.state_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvfleet-cluster-")
            kubelet = replace(kubelet, state_dir=Path(self._tmp.name))
        assert kubelet.state_dir is not None
        tls = self.pki.server_context(kubelet.state_dir / "pki")
        # Open watches and log streams end when the cluster stops; a short shutdown timeout
        # cuts whatever a client still holds open instead of waiting a minute for it.
        self._runner = aiohttp.web.ServerRunner(
            aiohttp.web.Server(self.api), handle_signals=False, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = aiohttp.web.TCPSite(self._runner, cfg.host, cfg.port or 0, ssl_context=tls)
        await site.start()
        self._port = self._runner.addresses[0][1]
        self.api.load_resources()
        if cfg.crds_dir is not None:
            self.api.load_crds(cfg.crds_dir)
        if cfg.monitoring_crds:
            self.api.apply_crds(monitoring_crds())
        for ns in sorted({"default", cfg.namespace}):
            self.api.admission.ensure_default_service_account(ns)
        document = kubeconfig_document(self.url, cfg.namespace, self.pki.ca_pem, self.admin_token)
        # It holds an admin token: readable by its owner only.
        replace_file(cfg.kubeconfig, yaml.safe_dump(document, sort_keys=False), mode=0o600)
        if cfg.controllers:
            access = ClusterAccess(
                cfg.host, self._port, self.pki.ca_pem, self.api.authn.issue_service_account_token
            )
            self.cluster = Cluster(self.api.store, kubelet, access)
            self.api.logs = self.cluster
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
        if self._runner is not None:
            await self._runner.cleanup()
        await self.api.__aexit__(exc_type, exc, tb)
        if self._tmp is not None:
            self._tmp.cleanup()
