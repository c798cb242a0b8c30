"""The operator installed as users install it: `kubectl apply -k manifests/`, running as a pod
under its own ServiceAccount and ClusterRole, logged in with the projected token; the
examples applied with kubectl serve a request through their gateway. Every request the
operator makes is authorized by RBAC, so a verb its ClusterRole lacks fails here, and a
verb it is granted but never uses is reported (least privilege)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from kvfleet_localcluster.local import LocalCluster
from tests.integration.test_kubectl import kubectl
from tests.support.cluster import cluster_config
from tests.support.objects import ROOT
from tests.support.waiting import until

OPERATOR = "system:serviceaccount:kvfleet-system:kvfleet-operator"
PODMONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "podmonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "names": {"kind": "PodMonitor", "plural": "podmonitors", "singular": "podmonitor"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}
HF_TOKEN = {
    "apiVersion": "v1",
    "kind": "Secret",
    "metadata": {"name": "hf-token", "namespace": "ai"},
    "stringData": {"token": "hf_placeholder"},
}
CHILD_KINDS = (
    "deployments",
    "services",
    "configmaps",
    "serviceaccounts",
    "poddisruptionbudgets",
    "networkpolicies",
    "roles",
    "rolebindings",
    "podmonitors",
    "persistentvolumeclaims",
)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    # No CRD preloaded: the manifests install it, as on a fresh cluster.
    config = cluster_config(tmp_path, crds=False, run_processes=True, time_scale=0.05)
    async with LocalCluster(config) as local:
        yield local


def granted(rbac: Path) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the operator's ClusterRole grants."""
    role = next(d for d in yaml.safe_load_all(rbac.read_text()) if d and d["kind"] == "ClusterRole")
    return {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


async def test_the_operator_runs_from_the_manifests_under_its_service_account(
    cluster: LocalCluster,
) -> None:
    kc = cluster.kubeconfig

    async def k(*args: str, stdin: str | None = None) -> str:
        return await kubectl(kc, *args, stdin=stdin)

    await k("apply", "-f", "-", stdin=yaml.safe_dump(PODMONITOR_CRD))
    await k("apply", "-k", str(ROOT / "manifests"))
    out = await k(
        "rollout", "status", "deployment/kvfleet-operator", "-n", "kvfleet-system", "--timeout=60s"
    )
    assert "successfully rolled out" in out
    for example in ("api-keys-secret.yaml", "mistral-7b-manual.yaml"):
        await k("apply", "-f", str(ROOT / "examples" / example))
    await k("apply", "-f", "-", stdin=yaml.safe_dump(HF_TOKEN))
    await k("apply", "-f", str(ROOT / "examples" / "llama-3.1-8b-h100-autoscaling.yaml"))

    # `kubectl wait` on the InferenceService's condition, as a pipeline would.
    out = await k("wait", "--for=condition=Ready", "kis/mistral", "-n", "ai", "--timeout=120s")
    assert "condition met" in out
    pods = json.loads(
        await k("get", "pods", "-n", "ai", "-l", "app.kubernetes.io/instance=mistral", "-o", "json")
    )["items"]
    gateway = next(
        p for p in pods if p["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"
    )
    body = {"model": "mistral-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"http://{gateway['status']['podIP']}:8080/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer foo"},
        ) as r,
    ):
        assert r.status == 200, await r.text()
        assert (await r.json())["usage"]["completion_tokens"] == 4

    # The autoscaled service: a model-cache claim and a warm spare labelled by the operator.
    async def warm_spare() -> bool:
        out = await k("get", "pods", "-n", "ai", "-l", "kvfleet.dev/role=warm", "-o", "name")
        return bool(out.strip())

    await until(warm_spare, 60, "a warm replica of llama-8b")
    assert "llama-8b" in await k("get", "pvc", "-n", "ai", "-o", "name")

    # Drift on every kind of child is put back (each kind's patch verb), ...
    for kind in CHILD_KINDS:
        await k(
            "label", "--overwrite", kind, "-n", "ai", "-l", "kvfleet.dev/inferenceservice",
            "app.kubernetes.io/name=tampered",
        )  # fmt: skip

    async def repaired() -> bool:
        for kind in CHILD_KINDS:
            out = await k(
                "get", kind, "-n", "ai", "-l", "app.kubernetes.io/name=tampered", "-o", "name"
            )
            if out.strip():
                return False
        return True

    await until(repaired, 60, "the operator to undo the drift")
    # ... and what a new spec no longer renders is deleted (each kind's delete verb).
    await k(
        "patch", "kis", "mistral", "-n", "ai", "--type=merge",
        "-p", json.dumps({"spec": {"gateway": {"enabled": False}}}),
    )  # fmt: skip

    async def gateway_gone() -> bool:
        out = await k(
            "get", "deployments,services,serviceaccounts,roles,rolebindings,networkpolicies,"
            "podmonitors", "-n", "ai",
            "-l", "app.kubernetes.io/instance=mistral,app.kubernetes.io/component=gateway",
            "-o", "name",
        )  # fmt: skip
        return not out.strip()

    await until(gateway_gone, 60, "mistral's gateway children to be deleted")

    # Every request of the operator pod was its service account's, and RBAC allowed each.
    records = [r for r in cluster.api.audit if r.user == OPERATOR]
    assert records, "the operator pod made no request as its service account"
    used = {
        (r.group, f"{r.resource}/{r.subresource}" if r.subresource else r.resource, r.verb)
        for r in records
    }
    owned = json.loads(
        await k(
            "get",
            "deployment",
            "-n",
            "ai",
            "llama-8b-engine",
            "-o",
            "json",
            "--show-managed-fields",
        )
    )
    assert "kvfleet-operator" in {e["manager"] for e in owned["metadata"]["managedFields"]}
    unused = granted(ROOT / "manifests" / "rbac.yaml") - used
    assert not unused, f"granted but never used by the operator: {sorted(unused)}"
