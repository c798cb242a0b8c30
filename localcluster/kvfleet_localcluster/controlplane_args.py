"""The command lines of the control plane's processes, and the files they read.

Every process listens on loopback ports of its own (never a component's default port), and
keeps every file in the control plane's state directory: several control planes run side by
side, one per test worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    lws_webhook: int
    lws_health: int


@dataclass(frozen=True)
class Files:
    """Where each credential and kubeconfig lives under the state directory."""

    root: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    def cert(self, name: str) -> Path:
        return self.pki / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.pki / f"{name}.key"

    @property
    def service_account_public(self) -> Path:
        return self.pki / "sa.pub"

    @property
    def tokens(self) -> Path:
        return self.pki / "tokens.csv"

    def kubeconfig(self, component: str) -> Path:
        return self.root / "kubeconfigs" / f"{component}.kubeconfig"

    def workdir(self, component: str) -> Path:
        return self.root / component

    def log(self, component: str) -> Path:
        return self.root / "logs" / f"{component}.log"


def etcd(binary: Path, files: Files, ports: Ports, fsync: bool) -> list[str]:
    peer = f"http://{HOST}:{ports.etcd_peer}"
    client = f"http://{HOST}:{ports.etcd_client}"
    argv = [
        str(binary),
        "--name=kvfleet",
        f"--data-dir={files.workdir('etcd')}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=kvfleet={peer}",
        "--log-level=warn",
    ]
    # A throwaway cluster's data: no fsync is several times faster on a shared disk.
    return argv if fsync else [*argv, "--unsafe-no-fsync"]


def apiserver(
    binary: Path, files: Files, ports: Ports, service_range: str, extra: tuple[str, ...]
) -> list[str]:
    return [
        str(binary),
        f"--etcd-servers=http://{HOST}:{ports.etcd_client}",
        f"--bind-address={HOST}",
        f"--secure-port={ports.apiserver}",
        # The Service `kubernetes` keeps no endpoints: a real server refuses loopback ones.
        f"--advertise-address={HOST}",
        "--endpoint-reconciler-type=none",
        f"--cert-dir={files.workdir('kube-apiserver')}",
        f"--tls-cert-file={files.cert('apiserver')}",
        f"--tls-private-key-file={files.key('apiserver')}",
        f"--client-ca-file={files.cert('ca')}",
        f"--token-auth-file={files.tokens}",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={files.service_account_public}",
        f"--service-account-signing-key-file={files.key('sa')}",
        f"--service-cluster-ip-range={service_range}",
        f"--kubelet-client-certificate={files.cert('apiserver-kubelet-client')}",
        f"--kubelet-client-key={files.key('apiserver-kubelet-client')}",
        # The aggregation layer's front proxy, as kubeadm sets it up: its CA completes the
        # `extension-apiserver-authentication` ConfigMap the controller manager, the scheduler
        # and any aggregated API server authenticate requests with.
        f"--requestheader-client-ca-file={files.cert('front-proxy-ca')}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={files.cert('front-proxy-client')}",
        f"--proxy-client-key-file={files.key('front-proxy-client')}",
        "--allow-privileged=true",
        "--profiling=false",
        *extra,
    ]


CONTROL_PLANE_USERS = (
    "system:kube-controller-manager",
    "system:kube-scheduler",
    "system:apiserver",
)
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        # The control plane's own traffic (node agents, controllers, the scheduler) is most
        # of all requests and says nothing about the clients under test.
        {"level": "None", "userGroups": ["system:nodes", "system:serviceaccounts:kube-system"]},
        {"level": "None", "users": [*CONTROL_PLANE_USERS]},
        {"level": "Metadata"},
    ],
}
"""What the audit log records: who asked for what, and the answer's code (not the bodies)."""


def audit(policy: Path, log: Path) -> tuple[str, ...]:
    """Flags of an audit log written as JSON lines, each event as soon as it happens."""
    return (
        f"--audit-policy-file={policy}",
        f"--audit-log-path={log}",
        "--audit-log-format=json",
        "--audit-log-mode=blocking",
        "--audit-log-maxsize=0",
    )


def _delegated(files: Files, component: str, port: int) -> list[str]:
    """Flags the controller manager and the scheduler share: their API credentials, their
    own /healthz on a loopback port, no leader election (one of each)."""
    kubeconfig = files.kubeconfig(component)
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={HOST}",
        f"--secure-port={port}",
        f"--cert-dir={files.workdir(component)}",
        "--leader-elect=false",
    ]


def controller_manager(binary: Path, files: Files, ports: Ports) -> list[str]:
    return [
        str(binary),
        *_delegated(files, "kube-controller-manager", ports.controller_manager),
        # Pods here have loopback addresses, which a real API server refuses in Endpoints and
        # EndpointSlices: those controllers would only post a Warning on every Service, so
        # they do not run and Services keep no endpoints (pods resolve Service names from the
        # node's Service table; kvfleet reads no EndpointSlice).
        "--controllers=*,-endpoints-controller,-endpointslice-controller,"
        "-endpointslice-mirroring-controller",
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={files.key('sa')}",
        f"--root-ca-file={files.cert('ca')}",
        # The CSR signer signs with the cluster CA: node agents may bootstrap certificates.
        f"--cluster-signing-cert-file={files.cert('ca')}",
        f"--cluster-signing-key-file={files.key('ca')}",
    ]


def scheduler(binary: Path, files: Files, ports: Ports) -> list[str]:
    return [str(binary), *_delegated(files, "kube-scheduler", ports.scheduler)]


def lws(binary: Path, files: Files) -> list[str]:
    return [
        str(binary),
        f"--kubeconfig={files.kubeconfig('lws-controller')}",
        f"--config={files.workdir('lws-controller') / 'config.yaml'}",
    ]
