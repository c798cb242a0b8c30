"""The local cluster on the real control plane: the real scheduler places pods on the node
agents' Nodes by their GPUs, the real Deployment controller rolls them, the node agent runs
them as processes and reports their status, and kubectl reads their logs through the real API
server — the node agent's kubelet API."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from kvfleet_localcluster.controlplane_build import ensure_built
from kvfleet_localcluster.kubelet import KubeletConfig
from kvfleet_localcluster.local import LocalCluster, LocalClusterConfig
from kvfleet_localcluster.node_agent import NodeSpec
from tests.conftest import kubectl_binary, require_binary
from tests.support.kubectl import get_json, kubectl, run_kubectl
from tests.support.waiting import until

# One cluster for the module: each test works on objects of its own.
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(1800)]

NODES = (
    NodeSpec("gpu-h100", gpus=2),
    NodeSpec("gpu-a100", gpus=1, gpu_product="NVIDIA-A100-SXM4-80GB"),
)
HELLO = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: hello, namespace: ai}
spec:
  replicas: 2
  selector: {matchLabels: {app: hello}}
  template:
    metadata: {labels: {app: hello}}
    spec:
      terminationGracePeriodSeconds: 30
      containers:
      - name: main
        image: python:3.11
        command: [python3, -u, -c]
        args: ["import time; print('hello from', flush=True); time.sleep(3600)"]
"""
GREEDY = """
apiVersion: v1
kind: Pod
metadata: {name: greedy, namespace: ai}
spec:
  containers:
  - name: main
    image: python:3.11
    command: [python3, -c, "import time; time.sleep(3600)"]
    resources: {limits: {nvidia.com/gpu: 4}}
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalCluster]:
    require_binary("go")  # skipped here without Go; CI fails instead
    await asyncio.to_thread(ensure_built)
    tmp_path = tmp_path_factory.mktemp("real-cluster")
    config = LocalClusterConfig(
        kubeconfig=tmp_path / "kubeconfig",
        namespace="ai",
        monitoring_crds=False,
        lws=False,
        nodes=NODES,
        kubelet=KubeletConfig(run_processes=True, time_scale=0.05, state_dir=tmp_path / "state"),
    )
    async with LocalCluster(config) as local:
        yield local


async def test_nodes_register_ready_with_their_gpus(cluster: LocalCluster) -> None:
    kc = cluster.kubeconfig
    version = json.loads(await kubectl(kc, "version", "-o", "json"))
    assert version["serverVersion"]["gitVersion"] == "v1.37.2"

    async def ready() -> bool:
        nodes = (await get_json(kc, "nodes"))["items"]
        return len(nodes) == 2 and all(  # type: ignore[arg-type]
            any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
            for n in nodes  # type: ignore[union-attr]
        )

    await until(ready, 60, "both nodes Ready", interval=0.3)
    a100 = await get_json(kc, "node", "gpu-a100")
    assert a100["status"]["allocatable"]["nvidia.com/gpu"] == "1"  # type: ignore[index]
    labels = a100["metadata"]["labels"]  # type: ignore[index]
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    lease = await get_json(kc, "lease", "-n", "kube-node-lease", "gpu-h100")
    assert lease["spec"]["holderIdentity"] == "gpu-h100"  # type: ignore[index]


async def test_a_deployment_runs_as_processes_and_its_logs_come_through_the_api_server(
    cluster: LocalCluster,
) -> None:
    kc = cluster.kubeconfig
    await kubectl(kc, "apply", "-f", "-", stdin=HELLO)
    await kubectl(kc, "rollout", "status", "deployment/hello", "--timeout=90s")
    pods = (await get_json(kc, "pods", "-l", "app=hello"))["items"]
    assert len(pods) == 2  # type: ignore[arg-type]
    for pod in pods:  # type: ignore[union-attr]
        assert pod["spec"]["nodeName"] in ("gpu-h100", "gpu-a100")
        assert pod["status"]["podIP"].startswith("127.")
        assert pod["status"]["phase"] == "Running"

    async def logged() -> bool:
        code, out, _ = await run_kubectl(
            kc, "logs", f"pod/{pods[0]['metadata']['name']}", stdin=None
        )  # type: ignore[index]
        return code == 0 and "hello from" in out

    await until(logged, 60, "the pod's output through kubectl logs", interval=0.3)
    code, _, err = await run_kubectl(
        kc, "exec", f"pod/{pods[0]['metadata']['name']}", "--", "ls", stdin=None
    )  # type: ignore[index]
    assert code != 0 and "not supported on the kvfleet local cluster" in err

    await kubectl(kc, "delete", "deployment", "hello", "--wait=false")

    async def gone() -> bool:
        return not (await get_json(kc, "pods", "-l", "app=hello"))["items"]

    await until(
        gone,
        60,
        "the deployment's pods deleted by the garbage collector and the node",
        interval=0.3,
    )


async def test_a_pod_asking_for_more_gpus_than_any_node_has_stays_pending(
    cluster: LocalCluster,
) -> None:
    kc = cluster.kubeconfig
    await kubectl(kc, "apply", "-f", "-", stdin=GREEDY)

    async def refused() -> bool:
        events = await get_json(kc, "events", "--field-selector", "involvedObject.name=greedy")
        return any(
            e["reason"] == "FailedScheduling" and "Insufficient nvidia.com/gpu" in e["message"]
            for e in events["items"]  # type: ignore[union-attr]
        )

    await until(refused, 60, "the scheduler's FailedScheduling event", interval=0.3)
    pod = await get_json(kc, "pod", "greedy")
    assert pod["status"]["phase"] == "Pending"  # type: ignore[index]
    assert "nodeName" not in pod["spec"]  # type: ignore[operator]


WEB = """
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: ai, labels: {app: web}}
spec:
  containers:
  - name: main
    image: python:3.11
    command: [python3, -m, http.server, "8000"]
    ports: [{containerPort: 8000}]
    readinessProbe: {tcpSocket: {port: 8000}, periodSeconds: 1}
"""


async def test_port_forward_reaches_the_pod_through_the_api_server_and_the_node(
    cluster: LocalCluster, unused_tcp_port: int
) -> None:
    kc = cluster.kubeconfig
    await kubectl(kc, "apply", "-f", "-", stdin=WEB)
    await kubectl(kc, "wait", "--for=condition=Ready", "pod/web", "--timeout=60s")
    forward = await asyncio.create_subprocess_exec(
        kubectl_binary(), "--kubeconfig", str(kc), "port-forward", "pod/web",
        f"{unused_tcp_port}:8000", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert forward.stdout is not None
        line = await asyncio.wait_for(forward.stdout.readline(), 30)
        assert b"Forwarding from" in line, line
        async with aiohttp.ClientSession() as http:
            for _ in range(2):  # two connections over one port-forward session
                url = f"http://127.0.0.1:{unused_tcp_port}/"
                async with http.get(url) as resp:
                    assert resp.status == 200
                    assert "Directory listing" in await resp.text()
    finally:
        forward.terminate()
        await forward.wait()
        assert forward.stderr is not None
        # Shown with a failure: kubectl names a stream it could not create or an error the
        # node sent (once, under load, a connection was closed with no answer).
        print("kubectl port-forward's stderr:", (await forward.stderr.read()).decode())


EXAMPLE = "llama-3.1-8b-h100-autoscaling.yaml"
