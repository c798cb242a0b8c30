"""The local cluster on the real Kubernetes control plane: etcd, kube-apiserver, the
controller manager, the scheduler and the LeaderWorkerSet controller built from their Go
modules (`controlplane.py`), and node agents that run the pods the scheduler binds to them
as local processes (`cluster_nodes.py`).

    async with LocalCluster(LocalClusterConfig(kubeconfig=Path("kc"))) as cluster:
        ...  # kubectl --kubeconfig kc ...

One implementation serves the tests, the demo and `kvfleet cluster up`.

Networking: pods get loopback addresses (127.<range>.x.y, `addresses.py`), bound by their
processes. A real API server refuses loopback addresses in Endpoints and EndpointSlices and
for its pod proxy (`.../pods/NAME/proxy`), so the Endpoints and EndpointSlice controllers do
not run (they would post a Warning on every Service) and Services keep no endpoints, and the
pod proxy is refused. Everything else works: Service names resolve inside pods from the
node's Service table (`services.py`), `kubectl logs` and `port-forward` go through the node
agent's kubelet API, and nothing in kvfleet reads EndpointSlices (the gateway discovers
engine pods by label).
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import aiohttp

from kvfleet_localcluster.cluster_nodes import DEFAULT_NODES, ApiAccess, ClusterNodes
from kvfleet_localcluster.controlplane import ControlPlane, ControlPlaneConfig
from kvfleet_localcluster.controlplane_args import HOST
from kvfleet_localcluster.files import replace_file
from kvfleet_localcluster.kubelet import KubeletConfig
from kvfleet_localcluster.node_agent import NodeSpec
from kvfleet_localcluster.pki import ClusterPKI

KUBELET_ADDRESS_FLAGS = ("--kubelet-preferred-address-types=InternalIP",)
"""The API server dials a node's kubelet API (logs) at its InternalIP, not its name."""


@dataclass(frozen=True)
class LocalClusterConfig:
    kubeconfig: Path
    """Written on start: an admin context pointing at the API server."""
    namespace: str = "default"
    """The kubeconfig context's namespace (created)."""
    crds_dir: Path | None = None
    """CRDs (YAML) to apply at start, e.g. the repository's `crds/`."""
    monitoring_crds: bool = True
    """The Prometheus Operator's PodMonitor and PrometheusRule CRDs, from its release."""
    lws: bool = True
    """Run the LeaderWorkerSet controller (its CRDs and webhooks)."""
    nodes: tuple[NodeSpec, ...] = DEFAULT_NODES
    """The simulated nodes; their GPUs are what the scheduler places engine pods on."""
    kubelet: KubeletConfig = field(default_factory=KubeletConfig)
    controllers: bool = True
    """False: the control plane alone (no node: pods stay Pending)."""
    audit_log: Path | None = None
    """The API server's audit log (`ControlPlaneConfig.audit_log`); None: none."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kubeconfig", self.kubeconfig.resolve())
        if self.crds_dir is not None:
            object.__setattr__(self, "crds_dir", self.crds_dir.resolve())


class LocalCluster:
    def __init__(self, config: LocalClusterConfig) -> None:
        self.config = config
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        state = config.kubelet.state_dir
        if state is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvfleet-cluster-")
            state = Path(self._tmp.name)
        self.state_dir = state.resolve()
        self.control_plane = ControlPlane(
            ControlPlaneConfig(
                # The user's kubeconfig appears only once the cluster is ready (a script
                # waits for it): the control plane's own copy is written first, in its state.
                kubeconfig=self.state_dir / "control-plane" / "admin.kubeconfig",
                namespace=config.namespace,
                state_dir=self.state_dir / "control-plane",
                lws=config.lws,
                monitoring_crds=config.monitoring_crds,
                crds_dir=config.crds_dir,
                apiserver_args=KUBELET_ADDRESS_FLAGS,
                audit_log=config.audit_log,
            )
        )
        self.nodes: ClusterNodes | None = None

    @property
    def url(self) -> str:
        return self.control_plane.url

    @property
    def kubeconfig(self) -> Path:
        return self.config.kubeconfig

    @property
    def admin_token(self) -> str:
        return self.control_plane.admin_token

    @property
    def ca_pem(self) -> bytes:
        return self.control_plane.ca_pem

    def session(self, token: str | None = None) -> aiohttp.ClientSession:
        """An HTTP client that trusts the cluster CA and sends `token` (default: the admin's)."""
        import ssl

        context = ssl.create_default_context(cadata=self.ca_pem.decode())
        return aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {token or self.admin_token}"},
            connector=aiohttp.TCPConnector(ssl=context),
        )

    def _node_certificate(self, name: str) -> tuple[Path, Path]:
        cert, key = self.control_plane.ca.sign(
            f"system:node:{name}", organizations=("system:nodes",), client=True
        )
        directory = self.state_dir / "nodes" / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "client.crt").write_bytes(cert)
        (directory / "client.key").touch(mode=0o600)
        (directory / "client.key").write_bytes(key)
        return directory / "client.crt", directory / "client.key"

    def _kubelet_tls(self) -> ClusterPKI:
        cert, key = self.control_plane.ca.sign("kubelet", [HOST, "localhost"])
        return ClusterPKI(self.ca_pem, cert, key)

    async def __aenter__(self) -> LocalCluster:
        await self.control_plane.__aenter__()
        try:
            if self.config.controllers:
                await self._start_nodes()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        # Written whole (a rename) and readable by its owner only: it holds an admin token.
        replace_file(self.config.kubeconfig, self.control_plane.kubeconfig.read_text(), mode=0o600)
        return self

    async def _start_nodes(self) -> None:
        kubelet = self.config.kubelet
        if kubelet.state_dir is None:
            kubelet = dataclasses.replace(kubelet, state_dir=self.state_dir)
        host, port = HOST, int(self.url.rsplit(":", 1)[1])
        access = ApiAccess(host, port, self.ca_pem, self.admin_token, self._node_certificate)
        tls = self._kubelet_tls().server_context(self.state_dir / "kubelet-pki")
        nodes = ClusterNodes(access, kubelet, self.config.nodes, tls)
        await nodes.__aenter__()
        self.nodes = nodes

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self.nodes is not None:
                await self.nodes.__aexit__(exc_type, exc, tb)
        finally:
            await self.control_plane.__aexit__(exc_type, exc, tb)
            if self._tmp is not None:
                self._tmp.cleanup()
