"""The spec model and its CRD: one source, CEL rules that hold, errors that name the field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvfleet_kernel.schema import ConfigError, evaluate
from kvfleet_operator.crd import CRD_FILE, crd, crd_yaml, stale_files
from kvfleet_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
K8S = "1.31.0"
BASE: dict[str, Any] = {
    "model": {"name": "llama", "source": {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"}},
    "gateway": {"apiKeysSecret": "keys"},
}


def spec_with(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(BASE)
    for path, value in changes.items():
        node = spec
        *parents, leaf = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return spec


def test_committed_crd_is_current() -> None:
    assert stale_files(ROOT / "crds") == [], "crds/ is stale: run make crds"
    assert (ROOT / "crds" / CRD_FILE).read_text() == crd_yaml()


def test_crd_is_a_valid_apiextensions_v1_object() -> None:
    kubernetes_validate.validate(crd(), K8S, strict=True)
    version = crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Model", "Active", "Warm", "Ready", "Queue", "KV", "TTFT p99", "Age"]


def _walk(schema: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    out = [(path, schema)]
    for name, sub in (schema.get("properties") or {}).items():
        out += _walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        out += _walk(schema["items"], f"{path}[]")
    return out


def test_every_spec_field_is_documented_and_structural() -> None:
    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    nodes = _walk(spec, "spec")
    assert len(nodes) > 80
    for path, node in nodes[1:]:
        if not path.endswith("[]"):
            assert node.get("description"), f"{path} has no description"
        assert "type" in node, f"{path} has no type (not a structural schema)"
    defaults = {p: n["default"] for p, n in nodes if "default" in n}
    assert defaults["spec.engine.tensorParallel"] == 1
    # Images are the operator's to default at render time, never frozen into stored objects.
    assert "spec.engine.image" not in defaults and "spec.gateway.image" not in defaults
    assert "spec.replicas" not in defaults, "a default would trip the replicas XOR autoscaling rule"


def test_defaults_applied() -> None:
    spec = parse_spec(BASE)
    assert spec.engine.tensor_parallel == 1
    assert spec.engine.schedule_policy == "fcfs"
    assert spec.manual_replicas == 1
    assert spec.gateway.routing_policy == "kvfleet"
    assert spec.engine.startup_timeout_seconds == 1800


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"replicas": 2, "autoscaling": {"maxReplicas": 4}}, "spec.replicas", "mutually exclusive"),
        (
            {"autoscaling": {"minReplicas": 5, "maxReplicas": 4}},
            "spec.autoscaling.minReplicas",
            "exceed",
        ),
        ({"engine__tensorParallel": 3}, "spec.engine.tensorParallel", "not one of 1, 2, 4, 8"),
        ({"engine__quantization": "int3"}, "spec.engine.quantization", "not one of"),
        ({"engine__extraArgs": ["--tp-size=2"]}, "spec.engine.extraArgs[0]", "manages"),
        ({"engine__extraArgs": ["--port", "1"]}, "spec.engine.extraArgs[0]", "manages"),
        (
            {"engine__speculative": {"algorithm": "EAGLE"}},
            "spec.engine.speculative.draftModel",
            "draftModel",
        ),
        ({"engine__memFractionStatic": 1.5}, "spec.engine.memFractionStatic", "maximum"),
        ({"engine__gpuType": "rtx4090"}, "spec.engine.gpuType", "not one of"),
        ({"engine__startupTimeoutSeconds": 10}, "spec.engine.startupTimeoutSeconds", "minimum"),
        (
            {"model__source": {"huggingFace": "a/b", "uri": "s3://x/y"}},
            "spec.model.source",
            "exactly one",
        ),
        ({"model__source": {}}, "spec.model.source", "exactly one"),
        ({"model__name": "bad:name"}, "spec.model.name", "does not match"),
        ({"gateway": {}}, "spec.gateway.apiKeysSecret", "apiKeysSecret"),
        ({"gateway__limitsStore": "mysql://x"}, "spec.gateway.limitsStore", "does not match"),
        (
            {"gateway__defaultLimits": {"maxTokens": 10, "defaultMaxTokens": 20}},
            "spec.gateway.defaultLimits.defaultMaxTokens",
            "exceed",
        ),
        (
            {"gateway__defaultLimits": {"tokenBudget": {"tokens": 5, "period": "1 week"}}},
            "spec.gateway.defaultLimits.tokenBudget.period",
            "not a duration",
        ),
        ({"modelCache": {}}, "spec.modelCache", "exactly one"),
        (
            {"autoscaling": {"minReplicas": 3, "warmReplicas": 2, "maxReplicas": 4}},
            "spec.autoscaling.warmReplicas",
            "fit within",
        ),
        ({"gateway__replicas": 2}, "spec.gateway.limitsStore", "shared limitsStore"),
        ({"replicas": "2"}, "spec.replicas", "not an integer"),
        ({"replicas": True}, "spec.replicas", "not an integer"),
        ({"enginee": {}}, "spec.enginee", "unknown field"),
        ({"engine__env": [{"name": "1BAD"}]}, "spec.engine.env[0].name", "does not match"),
        ({"engine__nodesPerReplica": 0}, "spec.engine.nodesPerReplica", "minimum"),
        ({"engine__nodesPerReplica": 17}, "spec.engine.nodesPerReplica", "maximum"),
        (
            {"engine__nodesPerReplica": 3, "engine__pipelineParallel": 2},
            "spec.engine.pipelineParallel",
            "must divide",
        ),
        ({"engine__extraArgs": ["--nnodes", "2"]}, "spec.engine.extraArgs[0]", "manages"),
        ({"engine__extraArgs": ["--dist-init=x:1"]}, "spec.engine.extraArgs[0]", "manages"),
    ],
)
def test_invalid_specs_name_their_field(changes: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_spec(spec_with(**changes))
    assert info.value.path == field
    assert words in str(info.value)


def test_missing_model_is_required() -> None:
    with pytest.raises(ConfigError, match=r"spec\.model: required"):
        parse_spec({"gateway": {"insecureNoAuth": True}})


def test_cel_rules_in_the_crd_are_the_ones_the_operator_evaluates() -> None:
    """Every x-kubernetes-validations rule compiles and holds on every example."""
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = [
        (p, r) for p, n in _walk(schema, "spec") for r in n.get("x-kubernetes-validations", [])
    ]
    assert len(rules) >= 8
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(example.read_text()):
            if doc["kind"] != "InferenceService":
                continue
            parse_spec(doc["spec"])
            # The top-level rule, evaluated as the API server would on the stored object.
            top = schema["x-kubernetes-validations"][0]["rule"]
            assert evaluate(top, doc["spec"]), example.name
