"""The real Kubernetes control plane built from its Go modules (kube-apiserver, etcd, the
controller manager, the scheduler, the LeaderWorkerSet controller), driven by the real kubectl.

No node agent runs here: pods stay Pending. A node registers with the credentials the control
plane issues for a node agent, so that the scheduler has a node to refuse.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from kvfleet_localcluster.controlplane import ControlPlane, ControlPlaneConfig, ControlPlaneError
from kvfleet_localcluster.controlplane_build import Binaries, ensure_built
from kvfleet_localcluster.controlplane_gomod import KUBERNETES_VERSION
from tests.conftest import require_binary
from tests.support.kubectl import get_json, kubectl, run_kubectl, wait_established
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[2]

# A cold build on a fresh machine happens inside the first test (about 15 minutes on 2 cores);
# .ci/run builds before the suite, so there the fixture finds the cache in milliseconds.
pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.xdist_group("controlplane"),
    pytest.mark.timeout(1800),
]


@pytest.fixture(scope="module")
def binaries() -> Binaries:
    require_binary("go")
    return ensure_built()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cp(
    binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ControlPlane]:
    config = ControlPlaneConfig(
        state_dir=tmp_path_factory.mktemp("controlplane"), namespace="demo", binaries=binaries
    )
    async with ControlPlane(config) as plane:
        print(f"control plane started in {plane.startup_s:.1f} s; RSS {plane.rss_bytes()}")
        yield plane


async def test_kubectl_sees_the_built_release(cp: ControlPlane) -> None:
    code, out, err = await run_kubectl(cp.kubeconfig, "version", "-o", "json")
    assert code == 0, err
    assert json.loads(out)["serverVersion"]["gitVersion"] == KUBERNETES_VERSION
    assert "version difference" not in err  # kubectl 1.37 against 1.37: no skew warning


async def test_openapi_v3_serves_the_builtin_groups_and_installed_crds(cp: ControlPlane) -> None:
    groups = {
        "api/v1",
        "apis/apps/v1",
        "apis/batch/v1",
        "apis/rbac.authorization.k8s.io/v1",
        "apis/coordination.k8s.io/v1",
        "apis/leaderworkerset.x-k8s.io/v1",
        "apis/monitoring.coreos.com/v1",
    }

    async def missing() -> set[str]:
        paths = json.loads(await kubectl(cp.kubeconfig, "get", "--raw", "/openapi/v3"))["paths"]
        return groups - set(paths)

    # A CRD's schema reaches /openapi/v3 a moment after the CRD is Established.
    async def none_missing() -> bool:
        return not await missing()

    await until(none_missing, 30, f"these groups in /openapi/v3: {groups}")


async def test_the_repository_crds_are_accepted_by_the_real_server(cp: ControlPlane) -> None:
    """CEL cost, structural schema and defaults as kube-apiserver itself judges them. (It
    refused both CRDs of the emulator's day: a fieldPath outside the schema, `\\-` in a CEL
    string, a default failing its own rule, a rule 5.8x over the cost budget.)"""
    for crd in sorted((ROOT / "crds").glob("kvfleet.dev_*.yaml")):
        await kubectl(cp.kubeconfig, "apply", "--server-side", "-f", str(crd))
    # Straight after the apply, as a user types it: kubectl's wait can read a CRD the
    # establishing controller has not yet given conditions (and fails on it, seen once).
    await wait_established(
        cp.kubeconfig, "inferenceservices.kvfleet.dev", "inferencegateways.kvfleet.dev"
    )


DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: demo}
spec:
  replicas: 2
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec: {containers: [{name: w, image: kvfleet:1}]}
"""


async def test_the_controller_manager_makes_replicasets_and_pods(cp: ControlPlane) -> None:
    await kubectl(cp.kubeconfig, "apply", "--server-side", "-f", "-", stdin=DEPLOYMENT)

    async def two_pending_pods() -> list[Any]:
        pods = (await get_json(cp.kubeconfig, "pods", "-n", "demo", "-l", "app=web"))["items"]
        return pods if len(pods) == 2 else []

    pods = await until(two_pending_pods, 60, "two pods of the Deployment")
    (owner,) = {ref["name"] for p in pods for ref in p["metadata"]["ownerReferences"]}
    rs = await get_json(cp.kubeconfig, "replicaset", owner, "-n", "demo")
    assert rs["metadata"]["ownerReferences"][0]["name"] == "web"
    assert {p["status"]["phase"] for p in pods} == {"Pending"}  # no node agent runs them
    # The ServiceAccount controller gave the namespace its `default` account.
    await get_json(cp.kubeconfig, "serviceaccount", "default", "-n", "demo")


NODE = {
    "apiVersion": "v1",
    "kind": "Node",
    "metadata": {"name": "gpu-node-1", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100"}},
    "status": {
        "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"},
        "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"},
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
    },
}
GREEDY_POD = """
apiVersion: v1
kind: Pod
metadata: {name: greedy, namespace: demo}
spec:
  # The node has no kubelet renewing it: once the node lifecycle controller taints it
  # not-ready (seen under load), the taint, not the GPUs, would be the scheduler's answer.
  tolerations: [{operator: Exists}]
  containers:
  - name: engine
    image: kvfleet:1
    resources: {limits: {nvidia.com/gpu: "99"}}
"""


async def test_the_scheduler_refuses_a_pod_asking_for_more_gpus_than_a_node_has(
    cp: ControlPlane,
) -> None:
    node_kubeconfig = cp.node_kubeconfig("gpu-node-1")
    # The node registers itself, as a node agent does: the Node authorizer admits it.
    await kubectl(node_kubeconfig, "create", "-f", "-", stdin=json.dumps(NODE))
    await kubectl(cp.kubeconfig, "apply", "--server-side", "-f", "-", stdin=GREEDY_POD)

    async def failed_scheduling() -> list[Any]:
        events = await get_json(
            cp.kubeconfig, "events", "-n", "demo", "--field-selector", "involvedObject.name=greedy"
        )
        return [e for e in events["items"] if e["reason"] == "FailedScheduling"]

    (event, *_) = await until(failed_scheduling, 60, "the FailedScheduling event")
    assert "Insufficient nvidia.com/gpu" in event["message"]
    assert event["reportingComponent"] == "default-scheduler"


LWS = """
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata: {name: multi, namespace: demo}
spec:
  replicas: 1
  leaderWorkerTemplate:
    size: 2
    workerTemplate:
      spec: {containers: [{name: engine, image: kvfleet:1}]}
"""


async def test_the_leaderworkerset_controller_and_its_webhooks_run(cp: ControlPlane) -> None:
    out = await kubectl(cp.kubeconfig, "apply", "--server-side", "-f", "-", stdin=LWS)
    assert "serverside-applied" in out
    lws = await get_json(cp.kubeconfig, "leaderworkerset", "multi", "-n", "demo")
    # The mutating webhook defaulted the spec (the CRD has no defaults for these).
    assert lws["spec"]["rolloutStrategy"]["type"] == "RollingUpdate"
    assert lws["spec"]["networkConfig"]["subdomainPolicy"] == "Shared"

    async def worker_pod() -> Any:
        code, out, _ = await run_kubectl(
            cp.kubeconfig, "get", "pod", "multi-0-1", "-n", "demo", "-o", "json"
        )
        return json.loads(out) if code == 0 else None

    # Leader StatefulSet (LWS controller) -> leader pod (StatefulSet controller, labelled by the
    # Pod webhook) -> worker StatefulSet `multi-0` (LWS pod controller) -> worker pod.
    pod = await until(worker_pod, 90, "the worker pod multi-0-1")
    assert pod["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "1"
    leader = await get_json(cp.kubeconfig, "pod", "multi-0", "-n", "demo")
    assert leader["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/group-index"] == "0"


async def test_a_failing_component_reports_its_log(binaries: Binaries, tmp_path: Path) -> None:
    config = ControlPlaneConfig(
        state_dir=tmp_path, binaries=binaries, apiserver_args=("--no-such-flag",), lws=False
    )
    with pytest.raises(ControlPlaneError, match="kube-apiserver exited") as raised:
        async with ControlPlane(config):
            pass
    assert "unknown flag: --no-such-flag" in str(raised.value)


OWNER = """
import asyncio, json, sys
from pathlib import Path
from kvfleet_localcluster.controlplane import ControlPlane, ControlPlaneConfig
from kvfleet_localcluster.controlplane_build import Binaries

async def main():
    config = ControlPlaneConfig(binaries=Binaries(Path(sys.argv[1])), lws=False)
    async with ControlPlane(config) as cp:
        print(json.dumps(cp.pids()), flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def test_no_component_outlives_its_owner_killed_by_sigkill(binaries: Binaries) -> None:
    owner = await asyncio.create_subprocess_exec(
        sys.executable, "-c", OWNER, str(binaries.directory),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert owner.stdout is not None
    pids = json.loads(await owner.stdout.readline())
    assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}
    os.kill(owner.pid, signal.SIGKILL)
    await owner.wait()

    async def all_gone() -> bool:
        return not any(_alive(pid) for pid in pids.values())

    await until(all_gone, 30, "every component to exit")


async def test_a_service_account_token_logs_in_as_its_account(cp: ControlPlane) -> None:
    async def default_account() -> bool:
        code, _, _ = await run_kubectl(
            cp.kubeconfig, "get", "serviceaccount", "default", "-n", "demo"
        )
        return code == 0

    await until(default_account, 30, "the ServiceAccount controller's default account")
    token = await cp.service_account_token("demo", "default", seconds=600)
    whoami = json.loads(
        await kubectl(cp.kubeconfig, "auth", "whoami", "-o", "json", "--token", token)
    )
    assert whoami["status"]["userInfo"]["username"] == "system:serviceaccount:demo:default"
    # RBAC is on: the account may not list Secrets until a Role grants it.
    code, _, err = await run_kubectl(
        cp.kubeconfig, "get", "secrets", "-n", "demo", "--token", token
    )
    assert code != 0 and "forbidden" in err.lower()
