"""manifests/: the kustomize base renders with the real kubectl, every object is valid for
Kubernetes 1.31, the ClusterRole grants exactly what the operator calls, and the alert rules
pass promtool."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from kvfleet_operator.kube import PRUNABLE, RESOURCES
from tests.conftest import kubectl_binary, require_binary

ROOT = Path(__file__).resolve().parents[2]


def kustomize(path: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        [kubectl_binary(), "kustomize", str(path)], check=True, capture_output=True, text=True
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_base_renders_and_validates() -> None:
    objs = kustomize(ROOT / "manifests")
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "CustomResourceDefinition",
        "Deployment",
        "Namespace",
        "ServiceAccount",
    ]
    for obj in objs:
        kubernetes_validate.validate(obj, "1.31.0", strict=True)
        if obj["kind"] not in (
            "Namespace",
            "CustomResourceDefinition",
            "ClusterRole",
            "ClusterRoleBinding",
        ):
            assert obj["metadata"]["namespace"] == "kvfleet-system"
    dep = next(o for o in objs if o["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"][0] == "operator"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["resources"]["requests"]


def test_cluster_role_grants_what_the_operator_uses() -> None:
    role = next(o for o in kustomize(ROOT / "manifests") if o["kind"] == "ClusterRole")
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                granted.setdefault((group, res), set()).update(rule["verbs"])
    assert not any("*" in v for v in granted.values())
    prunable = {r.plural for r in PRUNABLE}
    for r in RESOURCES.values():
        group = "" if r.api_version == "v1" else r.api_version.rsplit("/", 1)[0]
        verbs = granted.get((group, r.plural))
        assert verbs, f"the ClusterRole misses {group}/{r.plural}"
        assert ("delete" in verbs) == (r.plural in prunable), r.plural
        if r.kind in ("InferenceService", "InferenceGateway"):
            assert verbs == {"list", "watch"}
            assert granted[(group, f"{r.plural}/status")] == {"patch"}
        elif r.kind == "Event":  # list: why a pod waits (FailedMount), never watched
            assert verbs == {"list", "create"}
        elif r.kind == "Pod":
            assert verbs == {"list", "watch", "patch"}
        else:  # reads come from the watch cache (list + watch), never a get
            assert {"list", "watch", "create", "patch"} <= verbs, r.kind
            assert "get" not in verbs, r.kind
        if r.plural in prunable:
            assert "list" in verbs, r.plural


def test_monitoring_renders_and_rules_pass_promtool(tmp_path: Path) -> None:
    objs = kustomize(ROOT / "manifests" / "monitoring")
    rule = next(o for o in objs if o["kind"] == "PrometheusRule")
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {
        "KvfleetQueueBackingUp",
        "KvfleetKVCacheSaturated",
        "KvfleetNoReadyReplicas",
        "KvfleetTokenBudgetExhausted",
    } <= alerts
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    # The operator's PodMonitor selects the operator's pods, on a port they declare.
    monitor = next(o for o in objs if o["kind"] == "PodMonitor")
    operator = next(o for o in kustomize(ROOT / "manifests") if o["kind"] == "Deployment")
    template = operator["spec"]["template"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports") or []}
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] in ports
    dashboard = json.loads(cm["data"]["kvfleet-dashboard.json"])
    titles = " ".join(p["title"] for p in dashboard["panels"])
    for word in (
        "Time to first token",
        "Tokens per second",
        "Queue",
        "KV cache",
        "Replicas",
        "Cost per request",
    ):
        assert word in titles
    promtool = require_binary("promtool")
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(rules_file)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_scrape_config_example_passes_promtool(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    doc = yaml.safe_load(
        (ROOT / "manifests" / "monitoring" / "prometheus-scrape-config.yaml").read_text()
    )
    # Debian's Prometheus is built without Kubernetes discovery: check the relabelling with
    # file discovery in its place (the relabel rules are what could be wrong).
    (job,) = doc["scrape_configs"]
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    job["file_sd_configs"] = [{"files": [str(tmp_path / "targets.json")]}]
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(doc))
    result = subprocess.run([promtool, "check", "config", str(cfg)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_engine_network_policy_admits_the_operator_as_installed() -> None:
    """The autoscaler's direct scrape reaches the engines: the policy's operator peer matches
    the Deployment in manifests/ (its pod labels; its namespace, which the operator reads from
    the downward API, so an install elsewhere is admitted too)."""
    from kvfleet_operator.render import owner_of, render_children
    from kvfleet_operator.render.common import DEFAULT_OPERATOR_NAMESPACE
    from kvfleet_operator.render.network import OPERATOR_POD_LABELS

    docs = list(yaml.safe_load_all((ROOT / "manifests" / "base" / "operator.yaml").read_text()))
    dep = next(d for d in docs if d and d["kind"] == "Deployment")
    assert dep["metadata"]["namespace"] == DEFAULT_OPERATOR_NAMESPACE
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "OPERATOR_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in env  # fmt: skip
    isvc = {"metadata": {"name": "m", "namespace": "ai", "uid": "u"},
            "spec": {"model": {"name": "m", "source": {"huggingFace": "org/m"}},
                     "gateway": {"insecureNoAuth": True}}}  # fmt: skip
    policies = [
        o for o in render_children(owner_of(isvc, "platform-ops")) if o["kind"] == "NetworkPolicy"
    ]
    peers = [p for pol in policies for rule in pol["spec"]["ingress"] for p in rule.get("from", [])]
    assert {"kubernetes.io/metadata.name": "platform-ops"} in [
        (p.get("namespaceSelector") or {}).get("matchLabels") for p in peers if "podSelector" in p
    ]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert OPERATOR_POD_LABELS.items() <= labels.items()
