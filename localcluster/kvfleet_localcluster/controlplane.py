"""The real Kubernetes control plane as local processes: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and (optionally) the LeaderWorkerSet controller.

    async with ControlPlane(ControlPlaneConfig()) as cp:
        cp.kubeconfig  # an admin (system:masters) kubeconfig with a bearer token

Each control plane has its own loopback ports and state directory, so several run at once.
Every process is in a process group of its own and is killed if this process dies, even by
SIGKILL (PR_SET_PDEATHSIG): no orphan keeps a port or writes to a removed directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import yaml

from kvfleet_localcluster import controlplane_args as args
from kvfleet_localcluster import controlplane_lws, inotify, kubeconfigs
from kvfleet_localcluster.controlplane_build import Binaries, ensure_built
from kvfleet_localcluster.files import replace_file
from kvfleet_localcluster.pki import CertificateAuthority, service_account_key_pair

Json = dict[str, Any]
log = logging.getLogger(__name__)
STOP_GRACE_S = 10.0
LOG_TAIL_LINES = 30
ADMIN_USER = "kvfleet-admin"
APPLY_KINDS = frozenset(
    {
        "CustomResourceDefinition",
        "ClusterRole",
        "ClusterRoleBinding",
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
    }
)
"""The cluster-scoped kinds `apply` installs (each kind's resource is its lowercase plural)."""


class ControlPlaneError(RuntimeError):
    pass


@dataclass(frozen=True)
class ControlPlaneConfig:
    kubeconfig: Path | None = None
    """Where to write the admin kubeconfig; None: `<state_dir>/kubeconfig`."""
    namespace: str = "default"
    """The kubeconfig's namespace (created if it does not exist)."""
    state_dir: Path | None = None
    """Logs, etcd's data, certificates; None: a temporary directory removed at stop."""
    lws: bool = True
    """Run the LeaderWorkerSet controller (its CRDs, RBAC and webhooks installed first)."""
    monitoring_crds: bool = True
    """Install the Prometheus Operator's PodMonitor and PrometheusRule CRDs."""
    crds_dir: Path | None = None
    """Apply the CRDs in this directory at start (e.g. crds/)."""
    service_cluster_ip_range: str = "10.96.0.0/16"
    etcd_fsync: bool = False
    startup_timeout_s: float = 120.0
    apiserver_args: tuple[str, ...] = ()
    """Extra kube-apiserver flags (feature gates)."""
    audit_log: Path | None = None
    """Write the API server's audit log here (JSON lines, `args.AUDIT_POLICY`): who asked
    for what and the answer's code, for every request but the control plane's own; None:
    no audit log."""
    binaries: Binaries | None = None
    """None: `ensure_built()` (a no-op once built)."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """SIGKILL, not SIGTERM: on SIGTERM kube-apiserver shuts down gracefully, which waits on
    an etcd dying beside it (measured: still running minutes later); no one is left to wait."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (held together while chosen, so none repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((args.HOST, 0))
        return [sock.getsockname()[1] for sock in socks]


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(lines)


@dataclass
class _Process:
    name: str
    proc: asyncio.subprocess.Process
    log: Path


@dataclass
class ControlPlane:
    config: ControlPlaneConfig
    ca: CertificateAuthority = field(default_factory=CertificateAuthority.create)
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    startup_s: float = 0.0
    """Seconds from the first process started to every component ready."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds from the start to each step's end (where the startup time goes)."""
    _procs: dict[str, _Process] = field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def __post_init__(self) -> None:
        state_dir = self.config.state_dir
        if state_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvfleet-cp-")
            state_dir = Path(self._tmp.name)
        self.state_dir = state_dir.resolve()
        self.files = args.Files(self.state_dir)
        self.ports = args.Ports(*_free_ports(7))
        self.url = f"https://{args.HOST}:{self.ports.apiserver}"
        self.kubeconfig = (self.config.kubeconfig or self.state_dir / "kubeconfig").resolve()
        self._tokens = {c: secrets.token_urlsafe(32) for c in ("kcm", "scheduler", "lws")}

    @property
    def ca_pem(self) -> bytes:
        return self.ca.cert_pem

    async def __aenter__(self) -> ControlPlane:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # -- credentials ---------------------------------------------------------------------

    def _write_credentials(self) -> None:
        f = self.files
        f.pki.mkdir(parents=True, exist_ok=True)
        replace_file(f.cert("ca"), self.ca.cert_pem.decode())
        replace_file(f.key("ca"), self.ca.key_pem.decode(), mode=0o600)
        front_proxy = CertificateAuthority.create()
        replace_file(f.cert("front-proxy-ca"), front_proxy.cert_pem.decode())
        leaves = {
            "front-proxy-client": front_proxy.sign("front-proxy-client", client=True),
            "apiserver": self.ca.sign("kube-apiserver", [args.HOST, "localhost", "kubernetes"]),
            "apiserver-kubelet-client": self.ca.sign("kube-apiserver-kubelet-client", client=True),
            "lws-webhook": self.ca.sign("lws-webhook", [args.HOST]),
        }
        for name, (cert, key) in leaves.items():
            replace_file(f.cert(name), cert.decode())
            replace_file(f.key(name), key.decode(), mode=0o600)
        private, public = service_account_key_pair()
        replace_file(f.key("sa"), private.decode(), mode=0o600)
        replace_file(f.service_account_public, public.decode())
        users = [
            (self.admin_token, ADMIN_USER, "system:masters"),
            (self._tokens["kcm"], "system:kube-controller-manager", ""),
            (self._tokens["scheduler"], "system:kube-scheduler", ""),
            (self._tokens["lws"], controlplane_lws.USER, ""),
        ]
        # token,user,uid,"group1,group2"
        rows = [f'{t},{u},{u},"{g}"' if g else f"{t},{u},{u}" for t, u, g in users]
        replace_file(f.tokens, "\n".join(rows) + "\n", mode=0o600)
        kubeconfigs.write(self.kubeconfig, self._token_kubeconfig(self.admin_token, ADMIN_USER))
        for component, token in (
            ("kube-controller-manager", self._tokens["kcm"]),
            ("kube-scheduler", self._tokens["scheduler"]),
            ("lws-controller", self._tokens["lws"]),
        ):
            kubeconfigs.write(f.kubeconfig(component), self._token_kubeconfig(token, component))

    def _token_kubeconfig(self, token: str, user: str) -> Json:
        return kubeconfigs.document(
            self.url, self.config.namespace, self.ca_pem, kubeconfigs.token_user(token), user
        )

    def node_kubeconfig(self, node_name: str) -> Path:
        """A kubeconfig for a node agent: user `system:node:<name>` in group `system:nodes`
        (client certificate), which the Node authorizer and NodeRestriction admit."""
        cert, key = self.ca.sign(
            f"system:node:{node_name}", organizations=("system:nodes",), client=True
        )
        doc = kubeconfigs.document(
            self.url,
            self.config.namespace,
            self.ca_pem,
            kubeconfigs.certificate_user(cert, key),
            f"system:node:{node_name}",
        )
        return kubeconfigs.write(self.state_dir / "nodes" / node_name / "kubeconfig", doc)

    async def service_account_token(
        self, namespace: str, name: str, audiences: tuple[str, ...] = (), seconds: int = 3600
    ) -> str:
        """A bound token of ServiceAccount `namespace/name` (TokenRequest), as a kubelet
        mounts into a pod's projected volume."""
        spec: Json = {"expirationSeconds": seconds}
        if audiences:
            spec["audiences"] = list(audiences)
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"
        result = await self.request("POST", path, json=body)
        return str(result["status"]["token"])

    # -- API access ----------------------------------------------------------------------

    def session(self) -> aiohttp.ClientSession:
        """An admin session on the API server (base URL set, CA trusted)."""
        ctx = ssl.create_default_context(cadata=self.ca_pem.decode())
        return aiohttp.ClientSession(
            self.url,
            headers={"Authorization": f"Bearer {self.admin_token}"},
            connector=aiohttp.TCPConnector(ssl=ctx),
        )

    async def request(self, method: str, path: str, **kwargs: Any) -> Json:
        async with self.session() as http, http.request(method, path, **kwargs) as resp:
            if resp.status >= 400:
                raise ControlPlaneError(f"{method} {path}: {resp.status} {await resp.text()}")
            result: Json = await resp.json()
            return result

    async def apply(self, docs: list[Json]) -> None:
        """Server-side apply of cluster-scoped setup objects (APPLY_KINDS), all at once: a
        large CRD takes the API server seconds to validate (LeaderWorkerSet's about 4 s)."""
        for doc in docs:
            if doc["kind"] not in APPLY_KINDS:
                raise ValueError(f"apply installs {sorted(APPLY_KINDS)}, not {doc['kind']}")
        await asyncio.gather(*(self._apply_one(doc) for doc in docs))

    async def _apply_one(self, doc: Json) -> None:
        path = f"/apis/{doc['apiVersion']}/{doc['kind'].lower()}s/{doc['metadata']['name']}"
        await self.request(
            "PATCH",
            path,
            params={"fieldManager": "kvfleet-controlplane", "force": "true"},
            data=yaml.safe_dump(doc),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )

    async def wait_established(self, crds: list[Json]) -> None:
        for crd in crds:
            path = (
                f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"
            )

            async def established(path: str = path) -> bool:
                # Conditions are null until the CRD controller first looks at it.
                status = (await self.request("GET", path)).get("status") or {}
                conds = status.get("conditions") or []
                return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

            await self._wait(f"CRD {crd['metadata']['name']} established", established)

    # -- processes -----------------------------------------------------------------------

    async def _spawn(self, name: str, argv: list[str]) -> None:
        log_path = self.files.log(name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.files.workdir(name).mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                cwd=self.files.workdir(name),
                start_new_session=True,  # a group of its own: a terminal's ^C is ours to pass
                preexec_fn=_die_with_parent,
            )
        self._procs[name] = _Process(name, proc, log_path)

    def _check_alive(self) -> None:
        for p in self._procs.values():
            if p.proc.returncode is not None:
                tail = _tail(p.log)
                raise ControlPlaneError(
                    f"{p.name} exited with code {p.proc.returncode}; its log ({p.log}):\n"
                    + tail
                    + inotify.explain_exit(tail)
                )

    async def _wait(self, what: str, ready: Callable[[], Any]) -> None:
        """Poll `ready()` until true; a component that exits, or the timeout, is an error
        that carries the logs' tails."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            self._check_alive()
            with contextlib.suppress(aiohttp.ClientError, OSError, ControlPlaneError):
                if await ready():
                    return
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- {p.name} ({p.log}):\n{_tail(p.log)}" for p in self._procs.values()
                )
                raise ControlPlaneError(f"timed out waiting for {what}\n{tails}")
            await asyncio.sleep(0.1)

    async def _http_ok(self, url: str) -> bool:
        # The controller manager's and scheduler's serving certificates are self-signed.
        async with aiohttp.ClientSession() as http, http.get(url, ssl=False) as resp:
            return resp.status == 200

    async def _apiserver_ready(self) -> bool:
        async with self.session() as http, http.get("/readyz") as resp:
            return resp.status == 200

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        binaries = self.config.binaries
        if binaries is None:
            binaries = await asyncio.to_thread(ensure_built)
        # Refused before anything starts, with the remedy, rather than a component dying
        # half-way with "too many open files".
        if (short := inotify.shortfall()) is not None:
            raise ControlPlaneError(f"cannot start another control plane: {short}")
        self._write_credentials()
        started = time.monotonic()
        f, ports = self.files, self.ports
        # The API server retries etcd until it answers: both start at once.
        await self._spawn(
            "etcd", args.etcd(binaries.path("etcd"), f, ports, self.config.etcd_fsync)
        )
        await self._spawn(
            "kube-apiserver",
            args.apiserver(
                binaries.path("kube-apiserver"),
                f,
                ports,
                self.config.service_cluster_ip_range,
                (*self.config.apiserver_args, *self._audit_flags()),
            ),
        )
        await self._wait("kube-apiserver /readyz", self._apiserver_ready)
        self._mark("kube-apiserver ready", started)
        # The CRDs before the controllers: each new CRD makes every discovery client (the
        # garbage collector's, the quota controller's) look again, which is slow when all
        # of them start at once.
        await self._ensure_namespace(self.config.namespace)
        crds = self._crds(binaries)
        await self.apply(crds)
        self._mark("CRDs applied", started)
        kcm = binaries.path("kube-controller-manager")
        await self._spawn("kube-controller-manager", args.controller_manager(kcm, f, ports))
        sched = binaries.path("kube-scheduler")
        await self._spawn("kube-scheduler", args.scheduler(sched, f, ports))
        if self.config.lws:
            await self._start_lws(binaries)
            self._mark("lws-controller ready", started)
        await self.wait_established(crds)
        self._mark("CRDs established", started)
        for name, port in (
            ("kube-controller-manager", ports.controller_manager),
            ("kube-scheduler", ports.scheduler),
        ):
            url = f"https://{args.HOST}:{port}/healthz"
            await self._wait(f"{name} /healthz", functools.partial(self._http_ok, url))
        # The controller manager gives a new namespace its `default` ServiceAccount a moment
        # later, and a pod created before then is refused: ready means ready for pods.
        account = f"/api/v1/namespaces/{self.config.namespace}/serviceaccounts/default"
        await self._wait(
            f"{self.config.namespace}/default ServiceAccount", lambda: self.request("GET", account)
        )
        self._mark("default ServiceAccount", started)
        self.startup_s = time.monotonic() - started
        log.info("control plane %s ready in %.1f s: %s", self.url, self.startup_s, self.phases)

    def _audit_flags(self) -> tuple[str, ...]:
        if self.config.audit_log is None:
            return ()
        policy = self.state_dir / "audit-policy.yaml"
        replace_file(policy, yaml.safe_dump(args.AUDIT_POLICY))
        return args.audit(policy, self.config.audit_log.resolve())

    def _mark(self, phase: str, started: float) -> None:
        self.phases[phase] = round(time.monotonic() - started, 2)

    def _crds(self, binaries: Binaries) -> list[Json]:
        paths = list(binaries.monitoring_crds) if self.config.monitoring_crds else []
        if self.config.crds_dir is not None:
            paths += sorted(self.config.crds_dir.glob("*.yaml"))
        # A CRD folder may hold a kustomization beside the CRDs: only CRDs are installed.
        docs = [
            d
            for p in paths
            for d in yaml.safe_load_all(p.read_text())
            if d and d.get("kind") == "CustomResourceDefinition"
        ]
        return docs + (controlplane_lws.crds(binaries) if self.config.lws else [])

    async def _ensure_namespace(self, name: str) -> None:
        with contextlib.suppress(ControlPlaneError):  # 409: it exists (`default` always does)
            await self.request(
                "POST",
                "/api/v1/namespaces",
                json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
            )

    async def _start_lws(self, binaries: Binaries) -> None:
        workdir = self.files.workdir("lws-controller")
        cert_dir = workdir / "certs"
        cert_dir.mkdir(parents=True, exist_ok=True)
        # controller-runtime's webhook server reads tls.crt / tls.key from its cert dir.
        shutil.copyfile(self.files.cert("lws-webhook"), cert_dir / "tls.crt")
        shutil.copyfile(self.files.key("lws-webhook"), cert_dir / "tls.key")
        replace_file(
            workdir / "config.yaml",
            controlplane_lws.configuration(self.ports.lws_webhook, self.ports.lws_health, cert_dir),
        )
        webhook_url = f"https://{args.HOST}:{self.ports.lws_webhook}"
        await self.apply(controlplane_lws.rbac(binaries))
        await self.apply(
            controlplane_lws.webhook_configurations(binaries.lws_dir, webhook_url, self.ca_pem)
        )
        await self._spawn("lws-controller", args.lws(binaries.path("lws-controller"), self.files))
        readyz = f"http://{args.HOST}:{self.ports.lws_health}/readyz"
        await self._wait("lws-controller /readyz", functools.partial(self._http_ok, readyz))

    async def _terminate(self, name: str) -> None:
        p = self._procs.pop(name, None)
        if p is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.proc.pid, sig)
            try:
                await asyncio.wait_for(p.proc.wait(), STOP_GRACE_S)
                return
            except TimeoutError:
                continue

    async def stop(self) -> None:
        """Clients first, the API server, then etcd (its data is then discarded anyway)."""
        order = (
            ("lws-controller", "kube-scheduler", "kube-controller-manager"),
            ("kube-apiserver",),
            ("etcd",),
        )
        for group in order:
            await asyncio.gather(*(self._terminate(name) for name in group))
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def rss_bytes(self) -> dict[str, int]:
        """Each running component's resident memory (Linux /proc)."""
        out = {}
        for name, p in self._procs.items():
            status = Path(f"/proc/{p.proc.pid}/status").read_text()
            (kib,) = [line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")]
            out[name] = int(kib) * 1024
        return out

    def pids(self) -> dict[str, int]:
        return {name: p.proc.pid for name, p in self._procs.items()}
