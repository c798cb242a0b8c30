"""`kvfleet cluster up` — the real control plane built from its Go modules and a node agent —
with pods as processes, driven like a real cluster: the CRD and an InferenceService applied
with kubectl, the real operator (`kvfleet operator`) reconciling, the real scheduler and
Deployment controller placing engine pods that run as simulator processes on distinct 127.x
addresses, the gateway pod discovering them through the API, a deleted pod replaced, a scale
to 3; then the cluster stops and no pod process is left."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_sim.procs import free_port, running_process
from tests.conftest import kubectl_binary
from tests.support.cluster import require_control_plane
from tests.support.objects import isvc
from tests.support.waiting import until_sync as until

ROOT = Path(__file__).resolve().parents[2]
START_S = 60.0
"""A control plane starts in about 10 s on two idle cores; the suite runs beside it."""
ISVC = yaml.safe_dump(
    isvc(
        "llama", namespace="default", engine={"gpuType": "h100", "contextLength": 8192}, replicas=2
    )
)


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 3.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw.startswith(b"{") else raw
    except urllib.error.HTTPError as exc:
        return exc.code, None


def refused(ip: str, port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://{ip}:{port}/health", timeout=1)
    except urllib.error.URLError as exc:
        return isinstance(exc.reason, ConnectionRefusedError)
    except OSError:
        return True
    return False


class Kubectl:
    def __init__(self, kubeconfig: Path) -> None:
        self.base = [
            kubectl_binary(),
            "--kubeconfig",
            str(kubeconfig),
            "--cache-dir",
            str(kubeconfig.parent / "cache"),
        ]

    def __call__(self, *args: str, stdin: str | None = None) -> str:
        out = subprocess.run(
            [*self.base, *args], input=stdin, capture_output=True, text=True, timeout=20
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    def pods(self, component: str) -> list[dict[str, Any]]:
        out = self("get", "pods", "-l", f"app.kubernetes.io/component={component}", "-o", "json")
        return json.loads(out)["items"]  # type: ignore[no-any-return]


def ready_ips(pods: list[dict[str, Any]]) -> list[str]:
    return [
        p["status"]["podIP"]
        for p in pods
        if any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (p.get("status") or {}).get("conditions") or []
        )
    ]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[str, Kubectl, ExitStack]]:
    with ExitStack() as processes:
        yield str(tmp_path), Kubectl(tmp_path / "kubeconfig"), processes


def test_thirty_second_scenario(stack: tuple[str, Kubectl, ExitStack]) -> None:
    started = time.monotonic()
    tmp, kubectl, processes = stack
    require_control_plane()
    kubeconfig = Path(tmp) / "kubeconfig"
    cluster = processes.enter_context(
        running_process(
            [
                sys.executable,
                "-m",
                "kvfleet_cli",
                "cluster",
                "up",
                "--kubeconfig",
                str(kubeconfig),
                "--no-lws",
                "--state-dir",
                f"{tmp}/state",
            ],
            log_path=Path(tmp) / "cluster.log",
        )
    )
    # The kubeconfig appears once the cluster is ready for pods.
    until(kubeconfig.exists, START_S, "the cluster's kubeconfig")
    startup_s = time.monotonic() - started

    assert "created" in kubectl(
        "apply", "-f", str(ROOT / "crds" / "kvfleet.dev_inferenceservices.yaml")
    )
    processes.enter_context(
        running_process(
            [
                sys.executable,
                "-m",
                "kvfleet_cli",
                "operator",
                "--kubeconfig",
                f"{tmp}/kubeconfig",
                "--resync",
                "5",
                "--metrics-port",  # not the default 8081: another cluster's pod may hold it
                str(free_port()),
            ],
            log_path=Path(tmp) / "operator.log",
        )
    )
    # A real API server serves a new CRD's kind a moment after creating it, as a user sees.
    kubectl("wait", "--for=condition=Established", "crd/inferenceservices.kvfleet.dev")
    assert "created" in kubectl("apply", "-f", "-", stdin=ISVC)

    # Two engine processes on distinct loopback addresses, answering /health.
    ips = until(
        lambda: (ips := ready_ips(kubectl.pods("engine"))) and len(ips) == 2 and ips,
        15,
        "2 ready engines",
    )
    assert len(set(ips)) == 2 and all(ip.startswith("127.") and ip != "127.0.0.1" for ip in ips)
    assert all(http(f"http://{ip}:30000/health")[0] == 200 for ip in ips)
    # The gateway pod found them through the API and serves the model.
    gw = until(lambda: ready_ips(kubectl.pods("gateway")), 10, "a ready gateway")[0]
    chat = {
        "model": "llama-3.1-8b",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    }
    _, body = until(
        lambda: (r := http(f"http://{gw}:8080/v1/chat/completions", chat))[0] == 200 and r,
        10,
        "a completion",
    )
    assert body["usage"]["completion_tokens"] == 4
    # The status follows the pods' events (eventually consistent, as every status is).
    until(
        lambda: (
            json.loads(kubectl("get", "kis", "llama", "-o", "json"))["status"].get("readyReplicas")
            == 2
        ),
        10,
        "the status to count 2 ready replicas",
    )

    # Delete a pod: its process stops, a new pod (new process, new address) replaces it.
    victim = kubectl.pods("engine")[0]
    victim_ip = victim["status"]["podIP"]
    kubectl("delete", "pod", victim["metadata"]["name"])
    until(lambda: refused(victim_ip, 30000), 5, "the deleted pod's process to stop")
    ips = until(
        lambda: (
            (ips := ready_ips(kubectl.pods("engine")))
            and len(ips) == 2
            and victim_ip not in ips
            and ips
        ),
        10,
        "a replacement",
    )
    assert all(http(f"http://{ip}:30000/health")[0] == 200 for ip in ips)

    # Scale to 3: a third process.
    kubectl("scale", "kis", "llama", "--replicas=3")
    ips = until(
        lambda: (ips := ready_ips(kubectl.pods("engine"))) and len(ips) == 3 and ips,
        10,
        "3 ready engines",
    )
    assert len(set(ips)) == 3 and all(http(f"http://{ip}:30000/health")[0] == 200 for ip in ips)

    # Stop the cluster: every pod process goes with it.
    processes.close()
    for ip, port_ in [(ip, 30000) for ip in ips] + [(gw, 8080)]:
        until(lambda ip=ip, port_=port_: refused(ip, port_), 5, f"{ip}:{port_} to stop")
    assert cluster.returncode == 0
    total = time.monotonic() - started
    assert total < START_S + 30, f"the scenario took {total:.1f}s"
    print(f"cluster start {startup_s:.2f}s, whole scenario {total:.1f}s")
