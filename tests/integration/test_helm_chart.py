"""The Helm chart (`charts/kvfleet`) and the kustomize base (`manifests/`) install the same
thing: the real helm (helm-binary) and the real kubectl's kustomize render both, and every
object must match but for the two labels Helm adds. Values move what they say they move."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator.crd import crd_yaml, stale_chart_files
from tests.conftest import dev_binary, kubectl_binary

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfleet"
HELM_ONLY_LABELS = ("app.kubernetes.io/managed-by", "helm.sh/chart")
Key = tuple[str, str]


def _objects(text: str) -> dict[Key, dict[str, Any]]:
    out: dict[Key, dict[str, Any]] = {}
    for doc in yaml.safe_load_all(text):
        if doc:
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{key} rendered twice"
            out[key] = doc
    return out


def helm(*args: str) -> dict[Key, dict[str, Any]]:
    cmd = [dev_binary("helm"), "template", "kvfleet", str(CHART), "-n", "kvfleet-system"]
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    objects = _objects(done.stdout)
    for obj in objects.values():
        labels = obj["metadata"].get("labels") or {}
        if obj["kind"] != "CustomResourceDefinition":  # crds/ is installed as is
            assert labels.get("app.kubernetes.io/managed-by") == "Helm", obj["metadata"]
        for label in HELM_ONLY_LABELS:
            labels.pop(label, None)
    return objects


def kustomize(directory: str) -> dict[Key, dict[str, Any]]:
    done = subprocess.run(
        [kubectl_binary(), "kustomize", str(ROOT / directory)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return _objects(done.stdout)


def test_the_chart_renders_the_objects_of_the_kustomize_base() -> None:
    # With its Namespace, as `helm template` renders it for GitOps.
    chart = helm("--include-crds", "--set", "createNamespace=true")
    base = kustomize("manifests")
    assert sorted(chart) == sorted(base)
    for key in base:
        assert chart[key] == base[key], key
    assert ("CustomResourceDefinition", "inferenceservices.kvfleet.dev") in chart


def test_namespaced_mode_renders_the_objects_of_manifests_namespaced() -> None:
    chart = helm(
        "--include-crds", "--set", "createNamespace=true",
        "--set", "rbac.scope=namespace", "--set", "rbac.namespaces={ai}",
    )  # fmt: skip
    overlay = kustomize("manifests/namespaced")
    assert sorted(chart) == sorted(overlay)
    for key in overlay:
        assert chart[key] == overlay[key], key
    assert ("ClusterRoleBinding", "kvfleet-operator") not in chart
    binding = chart["RoleBinding", "kvfleet-operator"]
    assert binding["metadata"]["namespace"] == "ai"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "kvfleet-operator"}  # fmt: skip
    # Without a list: the release's own namespace.
    own = helm("--set", "rbac.scope=namespace")
    assert own["RoleBinding", "kvfleet-operator"]["metadata"]["namespace"] == "kvfleet-system"
    args = own["Deployment", "kvfleet-operator"]["spec"]["template"]["spec"]["containers"][0]
    assert args["args"][:3] == ["operator", "--namespace", "kvfleet-system"]


def test_the_policy_values_become_the_operators_flags(tmp_path: Path) -> None:
    values = tmp_path / "policy.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "policy": {
                    "allowedImagePrefixes": ["registry.corp/"],
                    "requireImageDigest": True,
                    "allowedTolerationKeys": [],
                    "allowedPriorityClasses": ["gpu-high"],
                    "allowInsecureNoAuth": False,
                    "allowExternalServices": False,
                }
            }
        )
    )
    objects = helm("-f", str(values))
    args = objects["Deployment", "kvfleet-operator"]["spec"]["template"]["spec"]["containers"][0]
    assert args["args"][:11] == [
        "operator", "--allowed-image-prefix", "registry.corp/", "--require-image-digest",
        "--allowed-toleration-key", "-", "--allowed-priority-class", "gpu-high",
        "--forbid-insecure-no-auth", "--forbid-external-services", "--liveness",
    ]  # fmt: skip
    # The operator's own parser takes them.
    from kvfleet_cli.operator_cmds import operator

    ctx = operator.make_context("operator", list(args["args"][1:]))
    assert ctx.params["toleration_keys"] == ("-",) and ctx.params["forbid_external_services"]


def test_with_monitoring_the_chart_adds_the_objects_of_manifests_monitoring() -> None:
    plain, monitored = helm(), helm("--set", "monitoring.enabled=true")
    added = {k: v for k, v in monitored.items() if k not in plain}
    expected = kustomize("manifests/monitoring")
    assert sorted(added) == sorted(expected)
    for key in expected:
        assert added[key] == expected[key], key


def test_values_move_the_image_the_namespace_and_the_environment() -> None:
    objects = helm(
        "--set",
        "image.tag=0.2.0",
        "--set",
        "createNamespace=false",
        "--set",
        "operator.env[0].name=HTTPS_PROXY",
        "--set",
        "operator.env[0].value=http://proxy.corp:3128",
    )
    assert ("Namespace", "kvfleet-system") not in objects
    container = objects["Deployment", "kvfleet-operator"]["spec"]["template"]["spec"]["containers"][
        0
    ]
    assert container["image"] == "ghcr.io/kvfleet/kvfleet:0.2.0"
    assert container["env"] == [
        {
            "name": "OPERATOR_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        },
        {"name": "KVFLEET_IMAGE", "value": "ghcr.io/kvfleet/kvfleet:0.2.0"},  # the gateways'
        {"name": "HTTPS_PROXY", "value": "http://proxy.corp:3128"},
    ]


def test_an_overlays_images_move_the_operator_and_its_gateways_image(tmp_path: Path) -> None:
    """`images:` of a user's overlay rewrites the operator's image and its $KVFLEET_IMAGE,
    the image of the gateways it renders (the base's images.yaml configuration)."""
    for d in ("manifests", "crds"):
        shutil.copytree(ROOT / d, tmp_path / d)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "kustomization.yaml").write_text(
        "resources: [../manifests/namespaced]\n"
        "images:\n"
        "  - name: ghcr.io/kvfleet/kvfleet\n"
        "    newName: registry.example.com/ml-platform/kvfleet\n"
        "    newTag: 0.2.0\n"
    )
    done = subprocess.run(
        [kubectl_binary(), "kustomize", str(tmp_path / "mine")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    deployment = _objects(done.stdout)["Deployment", "kvfleet-operator"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    image = "registry.example.com/ml-platform/kvfleet:0.2.0"
    assert container["image"] == image
    assert {"name": "KVFLEET_IMAGE", "value": image} in container["env"]


def test_the_chart_lints_and_its_crd_is_the_generated_one() -> None:
    done = subprocess.run(
        [dev_binary("helm"), "lint", "--strict", str(CHART)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # --strict fails on warnings; only the recommended icon is missing (INFO).
    assert done.returncode == 0, done.stdout + done.stderr
    assert (CHART / "crds" / "kvfleet.dev_inferenceservices.yaml").read_text() == crd_yaml()
    # Self-contained: its crds/ and files/ are copies `make crds` writes, not links out of
    # the chart (each link was a `found symbolic link in path` warning on every install).
    assert stale_chart_files(CHART, ROOT / "manifests") == [], "run make crds"


def test_what_the_chart_renders_is_valid_for_kubernetes() -> None:
    import kubernetes_validate

    for obj in helm("--set", "monitoring.enabled=false").values():
        if obj["kind"] != "CustomResourceDefinition":
            kubernetes_validate.validate(obj, "1.31", strict=True)


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("operator.logLevel=verbose", "logLevel"),
        ("monitoring.enable=true", "enable"),  # a typo is not silently ignored
        ("rbac.scope=namespaces", "scope"),
        ("rbac.namespaces={Team_A}", "namespaces"),
    ],
)
def test_bad_values_fail_with_the_field_named(bad: str, says: str) -> None:
    """values.schema.json: `helm install` refuses before anything reaches the cluster."""
    cmd = [dev_binary("helm"), "template", "kvfleet", str(CHART), "--set", bad]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert says in done.stderr and "values don't meet the specifications" in done.stderr
