"""docs/install.md, run: every `sh` block of the page, in order, in one bash, against the local
cluster `kvfleet cluster up` starts (the real control plane, its default nodes, pods as
processes), in a scratch copy of the repository's charts and examples, with the installed
`kvfleet`, kubectl and helm on the PATH. A block the page marks `<!-- not run here: WHY -->`
is skipped and must say why; nothing else is changed but the port-forward's local port (a
free one: tests run beside each other)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvfleet_localcluster.local import LocalCluster
from tests.conftest import dev_binary, kubectl_binary
from tests.support.cluster import cluster_config
from tests.support.kubectl import kubectl
from tests.support.objects import ROOT

PAGE = ROOT / "docs" / "install.md"
SKIP = re.compile(r"^<!-- not run here: (.+) -->$")


def page_blocks() -> list[tuple[str | None, str]]:
    """(why it is not run, or None; its text) for every ```sh block of the page."""
    blocks: list[tuple[str | None, str]] = []
    lines = PAGE.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```sh":
            end = lines.index("```", i + 1)
            above = next((s for s in reversed(lines[:i]) if s.strip()), "")
            skip = SKIP.match(above.strip())
            blocks.append((skip.group(1) if skip else None, "\n".join(lines[i + 1 : end])))
            i = end
        i += 1
    return blocks


def test_only_the_docker_steps_are_not_run_and_they_say_why() -> None:
    blocks = page_blocks()
    assert len(blocks) >= 6
    for why, text in blocks:
        docker = all(line.startswith("docker ") for line in text.splitlines())
        assert (why is not None) == docker, (why, text)
        if why is not None:
            assert "tests/unit/test_docs_install.py" in why, why


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    # As `kvfleet cluster up` runs it: its nodes, LWS, the Prometheus Operator's CRDs, and no
    # kvfleet CRD (the chart installs it).
    config = dataclasses.replace(
        cluster_config(tmp_path, crds=False, lws=True, run_processes=True, time_scale=0.1),
        monitoring_crds=True,
        namespace="default",
    )
    async with LocalCluster(config) as local:
        yield local


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _bash(script: str, cwd: Path, kubeconfig: Path, timeout_s: float) -> str:
    tools = (sys.executable, kubectl_binary(), dev_binary("helm"))
    env = {
        "PATH": ":".join([*dict.fromkeys(str(Path(t).parent) for t in tools), "/usr/bin", "/bin"]),
        "HOME": str(cwd.parent),
        "LANG": "C.UTF-8",
        "KUBECONFIG": str(kubeconfig),
    }
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", script, cwd=cwd, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        out, _ = await proc.communicate()
        pytest.fail(f"the page's commands ran over {timeout_s} s:\n{out.decode()[-6000:]}")
    text = out.decode()
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{text[-6000:]}"
    return text


# 125-145 s measured beside other suites' runs (load average 13-27); shares its xdist group with
# the every-example story of test_operator_in_cluster.py: the two never load the machine
# together, and neither lengthens the README walkthrough's worker.
@pytest.mark.xdist_group("real-cluster-stories")
@pytest.mark.timeout(600)
async def test_the_install_page_runs_on_the_local_cluster(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    for d in ("charts", "examples", "manifests", "crds"):
        shutil.copytree(ROOT / d, work / d)
    port = _free_port()
    script = ["set -euo pipefail"]
    for n, (why, text) in enumerate(page_blocks()):
        if why is None:
            text = text.replace("8080:8080", f"{port}:8080").replace(
                "localhost:8080", f"localhost:{port}"
            )
            script += [f"echo; echo '::: block {n}'", text]
    out = await _bash("\n".join(script) + "\n", work, cluster.kubeconfig, 420)
    # The chart's operator ran the image the page overrode it to.
    assert "registry.example.com/ml-platform/kvfleet:0.1.0" in out
    # The first request: a chat completion through the port-forward, with the key made.
    reply = json.loads(next(s for s in out.splitlines() if s.startswith('{"id"')))
    assert reply["usage"]["completion_tokens"] > 0, reply
    # Troubleshooting showed the service's conditions and its Events.
    assert "Serving" in out and "Created" in out
    # ... and the pods' images: the gateway runs the operator's own, the chart's override.
    gateway = next(line for line in out.splitlines() if line.startswith("mistral-gateway-"))
    assert gateway.split()[1] == "registry.example.com/ml-platform/kvfleet:0.1.0", gateway
    # Uninstalled: the CRDs, the operator and everything the services ran are gone.
    kc = cluster.kubeconfig
    crds = await kubectl(kc, "get", "crd", "-o", "name")
    assert "kvfleet.dev" not in crds, crds

    async def pods_in_ai() -> str:
        return await kubectl(kc, "get", "pods", "-n", "ai", "-o", "name")

    for _ in range(60):
        if not (await pods_in_ai()).strip():
            break
        await asyncio.sleep(1)
    assert not (await pods_in_ai()).strip()
    assert "kvfleet-system" not in await kubectl(kc, "get", "namespaces", "-o", "name") or (
        "Terminating" in await kubectl(kc, "get", "namespace", "kvfleet-system")
    )
