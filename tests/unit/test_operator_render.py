"""Pure renderers: every example renders to objects the real Kubernetes schemas accept, and
each child says what a production SGLang fleet needs."""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from kvfleet_cli.main import cli
from kvfleet_gateway.config import ConfigError, GatewayConfig
from kvfleet_operator.diff import (
    applied_fields,
    covers,
    needs_apply,
    own_resize,
    renders,
    upgraded_managed_fields,
    warm_assignment,
)
from kvfleet_operator.render import desired_engine_replicas, owner_of, render_children
from kvfleet_operator.render.gateway import CONFIG_KEY
from kvfleet_operator.scaling.policy import shrink_order

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml"))
K8S = "1.31.0"


def services(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for d in docs:
        d["metadata"].setdefault("uid", "5f0c2b9e-0000-4000-8000-000000000001")
    return [d for d in docs if d["kind"] == "InferenceService"]


def by_kind(objs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for o in objs:
        out.setdefault(o["kind"], []).append(o)
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_renders_valid_objects(path: Path) -> None:
    for doc in services(path):
        owner = owner_of(doc)
        objs = render_children(owner)
        kinds = by_kind(objs)
        workloads = [*kinds.get("Deployment", []), *kinds.get("LeaderWorkerSet", [])]
        assert set(kinds) >= {
            "Deployment",  # the gateway's, and the engine's unless it runs multi-node
            "Service",
            "PodDisruptionBudget",
            "NetworkPolicy",
            "PodMonitor",
            "ConfigMap",
            "ServiceAccount",
            "Role",
            "RoleBinding",
        }
        # Engines and gateway are both scraped, with the labels alerts and the autoscaler use.
        monitors = {o["metadata"]["name"] for o in kinds["PodMonitor"]}
        prefill = {owner.prefill_name} if owner.spec.disaggregation else set()
        assert monitors == {owner.engine_name, owner.gateway_name, *prefill}
        for obj in objs:
            ref = obj["metadata"]["ownerReferences"][0]
            assert (ref["kind"], ref["name"], ref["controller"]) == (
                "InferenceService",
                owner.name,
                True,
            )
            assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvfleet"
            assert obj["metadata"]["labels"]["kvfleet.dev/inferenceservice"] == owner.name
            if obj["kind"] == "PodMonitor":  # a CRD of the Prometheus Operator: no bundled schema
                # It names a port the selected pods declare (the gateway's metrics port is not
                # its API port).
                endpoint = obj["spec"]["podMetricsEndpoints"][0]
                selector = obj["spec"]["selector"]["matchLabels"]
                (pods,) = [
                    t
                    for d in workloads
                    for t in _templates(d, selector)
                    if _own(selector).items() <= t["metadata"]["labels"].items()
                ]
                ports = {p["name"] for c in pods["spec"]["containers"] for p in c["ports"]}
                assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
                continue
            if obj["kind"] == "LeaderWorkerSet":  # a CRD: its own schema (test_multinode.py)
                continue
            kubernetes_validate.validate(obj, K8S, strict=True)


LWS_LABELS = "leaderworkerset.sigs.k8s.io/"
"""Labels LeaderWorkerSet adds to the pods it creates (not in the templates)."""


def _own(selector: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in selector.items() if not k.startswith(LWS_LABELS)}


def _templates(workload: dict[str, Any], selector: dict[str, str]) -> list[dict[str, Any]]:
    """The pod templates `selector` picks: a Deployment's; a LeaderWorkerSet's leaders' (its
    pods' worker-index "0") or workers'."""
    if workload["kind"] == "Deployment":
        return [workload["spec"]["template"]]
    group = workload["spec"]["leaderWorkerTemplate"]
    leaders = selector.get(LWS_LABELS + "worker-index") == "0"
    return [group["leaderTemplate"] if leaders else group["workerTemplate"]]


def _engine(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(
        o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-engine")
    )


def test_engine_pod_for_llama_70b_tp4_on_h200() -> None:
    (doc,) = services(ROOT / "examples" / "llama-3.1-70b-tp4-h200.yaml")
    owner = owner_of(doc)
    dep = _engine(render_children(owner))
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["python3", "-m", "sglang.launch_server"]
    args = " ".join(c["args"])
    for flag in (
        "--model-path meta-llama/Llama-3.1-70B-Instruct",
        "--served-model-name llama-3.1-70b",
        "--host 0.0.0.0",
        "--port 30000",
        "--enable-metrics",
        "--tp-size 4",
        "--context-length 65536",
        "--mem-fraction-static 0.88",
        "--chunked-prefill-size 8192",
    ):
        assert flag in args, flag
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
    assert c["ports"][0]["containerPort"] == 30000
    # 2400 s of model load allowed before the kubelet gives up, then /health gates traffic.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 2400
    assert (
        c["readinessProbe"]["httpGet"]["path"] == c["livenessProbe"]["httpGet"]["path"] == "/health"
    )
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert vols["model-cache"]["persistentVolumeClaim"]["claimName"] == "model-weights-rwx"
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert pod["terminationGracePeriodSeconds"] == 120
    assert pod["priorityClassName"] == "inference-high"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    # Autoscaled: a new pod starts warm; the operator admits it to traffic.
    assert labels["kvfleet.dev/role"] == "warm"
    assert labels["app.kubernetes.io/component"] == "engine"
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "30000"


def test_flags_follow_the_spec() -> None:
    (doc,) = services(ROOT / "examples" / "qwen2.5-72b-fp8.yaml")
    doc["spec"]["engine"] |= {
        "radixCache": False,
        "extraArgs": ["--enable-torch-compile"],
        "speculative": {"algorithm": "NGRAM"},
    }
    args = _engine(render_children(owner_of(doc)))["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    line = shlex.join(args)
    assert "--quantization fp8" in line and "--kv-cache-dtype fp8_e4m3" in line
    assert "--disable-radix-cache" in args and args[-1] == "--enable-torch-compile"
    assert "--speculative-algorithm NGRAM" in line


def test_gateway_config_round_trips_through_the_gateway_parser() -> None:
    (doc,) = services(ROOT / "examples" / "llama-3.1-8b-h100-autoscaling.yaml")
    objs = render_children(owner_of(doc))
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    parsed = GatewayConfig.from_dict(yaml.safe_load(cm["data"][CONFIG_KEY]))
    assert GatewayConfig.from_dict(parsed.to_dict()) == parsed
    assert parsed.backends.kubernetes is not None
    assert parsed.backends.kubernetes.selector == (
        "kvfleet.dev/inferenceservice=llama-8b,app.kubernetes.io/component=engine,kvfleet.dev/role=active"
    )
    assert parsed.limits.store == "redis://redis.ai.svc:6379/0"
    assert parsed.limits.redis_outage.gateway_replicas == 2
    assert parsed.limits_for("search-team").max_concurrent == 128
    assert parsed.limits_for("other").max_concurrent == 32
    assert parsed.cost.gpu_hourly_price == 2.49
    assert parsed.models[0].name == "llama-3.1-8b" and parsed.models[0].context_length == 32768
    assert parsed.auth.keys_file is not None and parsed.auth.keys_file.endswith("keys.yaml")
    gw = next(
        o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-gateway")
    )
    pod = gw["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["containers"][0]["args"] == [
        "gateway",
        "--config",
        "/etc/kvfleet/config/gateway.yaml",
    ]
    role = next(o for o in objs if o["kind"] == "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]


def test_network_policy_admits_only_the_gateway_and_scrapers() -> None:
    (doc,) = services(ROOT / "examples" / "mistral-7b-manual.yaml")
    np = next(o for o in render_children(owner_of(doc)) if o["kind"] == "NetworkPolicy")
    gateway_peer = np["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert gateway_peer == {
        "kvfleet.dev/inferenceservice": "mistral",
        "app.kubernetes.io/component": "gateway",
    }
    assert np["spec"]["policyTypes"] == ["Ingress"]


def test_autoscaled_replicas_stay_within_bounds() -> None:
    (doc,) = services(ROOT / "examples" / "llama-3.1-8b-h100-autoscaling.yaml")
    owner = owner_of(doc)  # min 2, warm 1, max 8
    assert desired_engine_replicas(owner) == 3
    assert desired_engine_replicas(owner, current=6) == 6
    assert desired_engine_replicas(owner, current=1) == 3
    assert desired_engine_replicas(owner, current=50) == 8
    pvc = next(o for o in render_children(owner) if o["kind"] == "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def _pod(
    name: str, ready: bool, role: str = "active", created: str = "2026-01-01T00:00:00Z"
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {"kvfleet.dev/role": role},
            "creationTimestamp": created,
        },
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_warm_assignment_prefers_traffic_then_stability() -> None:
    pods = [
        _pod("a", True, created="2026-01-01T00:00:01Z"),
        _pod("b", True, created="2026-01-01T00:00:02Z"),
        _pod("c", True, created="2026-01-01T00:00:03Z"),
    ]
    assert warm_assignment(pods, warm_target=1, active_target=2) == {
        "a": "active",
        "b": "active",
        "c": "warm",
    }
    pods[0]["metadata"]["labels"]["kvfleet.dev/role"] = "warm"  # already warm: keep it
    assert warm_assignment(pods, 1, 2)["a"] == "warm"
    assert warm_assignment(pods[:2], 1, 2) == {"a": "active", "b": "active"}  # traffic first
    assert warm_assignment([_pod("x", False)], 1, 0) == {}


def test_a_shrinking_fleet_demotes_the_least_busy_active_pod_as_the_simulator_does() -> None:
    """The operator demotes by the simulator's order (`shrink_order`): fewest requests in
    flight first, a pod without a sample counted busy, then the newest."""
    pods = [
        _pod("a", True, created="2026-01-01T00:00:01Z"),
        _pod("b", True, created="2026-01-01T00:00:02Z"),
        _pod("c", True, created="2026-01-01T00:00:03Z"),
    ]
    # The newest (c) is busy, the oldest (a) idle: a goes, c keeps serving.
    assert warm_assignment(pods, 1, 2, {"a": 0, "b": 2, "c": 1})["a"] == "warm"
    # Equally busy: the newest.
    assert warm_assignment(pods, 1, 2, {"a": 1, "b": 1, "c": 1})["c"] == "warm"
    # No sample of b: it may be busy, so an idle pod with a sample goes first.
    assert warm_assignment(pods, 1, 2, {"a": 3, "c": 0})["c"] == "warm"
    assert warm_assignment(pods, 1, 2, {"a": 3, "c": 4})["a"] == "warm"
    # A pod already warm stays warm, whatever the loads say.
    pods[1]["metadata"]["labels"]["kvfleet.dev/role"] = "warm"
    assert warm_assignment(pods, 1, 2, {"a": 0, "b": 5, "c": 0})["b"] == "warm"
    # Two to demote out of three active: the two least busy.
    pods[1]["metadata"]["labels"]["kvfleet.dev/role"] = "active"
    roles = warm_assignment(pods, 3, 1, {"a": 2, "b": 0, "c": 1})
    assert roles == {"a": "active", "b": "warm", "c": "warm"}
    # The simulator's demotion (least in flight, then the highest index) is the same function.
    assert shrink_order([2, 0, 1], [0, 1, 2]) == [1, 2, 0]
    assert shrink_order([1, 1, 1], [0, 1, 2]) == [2, 1, 0]


def test_an_apply_is_due_only_when_a_rendered_field_differs_or_we_own_a_dropped_one() -> None:
    want = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "s", "labels": {"a": "1"}},
        "spec": {"ports": [{"port": 1}], "selector": {"x": "y"}},
    }
    ours = {
        "manager": "op",
        "operation": "Apply",
        "fieldsV1": {
            "f:metadata": {"f:labels": {"f:a": {}}},
            "f:spec": {"f:ports": {}, "f:selector": {"f:x": {}}},
        },
    }
    theirs = {"manager": "kubectl", "operation": "Update", "fieldsV1": {"f:spec": {"f:zz": {}}}}
    live = {
        "metadata": {
            "name": "s",
            "labels": {"a": "1", "other": "2"},
            "resourceVersion": "9",
            "managedFields": [theirs, ours],
        },
        "spec": {
            "ports": [{"port": 1, "protocol": "TCP"}],
            "selector": {"x": "y"},
            "clusterIP": "10.0.0.1",
            "zz": 1,
        },
    }
    assert not needs_apply(want, live, "op")  # defaults and other managers' fields ignored
    assert needs_apply(want, None, "op")
    assert needs_apply(want, live, "another-manager")  # never applied by it
    # Ports are a keyed list: another manager's port beside ours is not drift (an apply
    # would not remove it), our port changed or gone is.
    added = copy.deepcopy(live)
    added["spec"]["ports"].append({"port": 2})
    assert not needs_apply(want, added, "op")
    changed = copy.deepcopy(live)
    changed["spec"]["ports"][0]["port"] = 2
    assert needs_apply(want, changed, "op")
    # We stop rendering the selector's x: we own it, so an apply must remove it.
    dropped = copy.deepcopy(want)
    dropped["spec"]["selector"] = {}
    assert needs_apply(dropped, live, "op")
    assert covers({"cpu": 4}, {"cpu": "4"})
    # The selector is an atomic map: a key another writer added beside ours goes with the
    # next apply (a real API server replaces it whole), so it is drift, not theirs.
    extra = copy.deepcopy(live)
    extra["spec"]["selector"]["team"] = "web"
    assert needs_apply(want, extra, "op")


def test_a_node_selector_key_beside_ours_is_drift() -> None:
    """A pod's nodeSelector is replaced whole by an apply (`mapType: atomic`): a key an
    earlier writer left there (an old operator's merge patch) is removed by applying, so
    its presence makes an apply due (it was ignored as another manager's key, and stayed)."""
    selector = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    pod_spec = {"template": {"spec": {"nodeSelector": selector}}}
    want = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
            "spec": pod_spec}  # fmt: skip
    ours = {"manager": "op", "operation": "Apply",
            "fieldsV1": {"f:spec": {"f:template": {"f:spec": {"f:nodeSelector": {}}}}}}  # fmt: skip
    live = {"metadata": {"name": "d", "managedFields": [ours]}, "spec": copy.deepcopy(pod_spec)}
    assert not needs_apply(want, live, "op")
    live["spec"]["template"]["spec"]["nodeSelector"]["pool"] = "retired"
    assert needs_apply(want, live, "op")
    # A LabelSelector under `selector` is a struct, not an atomic map: compared as before.
    assert covers({"matchLabels": {"a": "1"}, "matchExpressions": []}, {"matchLabels": {"a": "1"}})


def test_a_resize_of_our_own_is_told_apart_from_drift() -> None:
    """Only `spec.replicas` differs and only the operator owns it: its own resize (a `Scaled`
    Event). Another field changed, or `kubectl scale` owns the replicas: drift."""
    want = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {
            "replicas": 4,
            "template": {"spec": {"containers": [{"name": "c", "image": "a"}]}},
        },
    }
    ours = {
        "manager": "op",
        "operation": "Apply",
        "fieldsV1": {"f:spec": {"f:replicas": {}, "f:template": {"f:spec": {"f:containers": {}}}}},
    }
    live = copy.deepcopy(want)
    live["metadata"]["managedFields"] = [ours]
    live["spec"]["replicas"] = 2
    assert own_resize(want, live, "op") == (2, 4)
    edited = copy.deepcopy(live)
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "evil"
    assert own_resize(want, edited, "op") is None
    by_hand = copy.deepcopy(live)
    scale = {"manager": "kubectl", "operation": "Update", "subresource": "scale",
             "fieldsV1": {"f:spec": {"f:replicas": {}}}}  # fmt: skip
    by_hand["metadata"]["managedFields"].append(scale)
    assert own_resize(want, by_hand, "op") is None
    assert own_resize(want, copy.deepcopy(want), "op") is None  # nothing to resize


def test_an_update_entry_of_ours_is_folded_into_our_apply_entry() -> None:
    """Fields an earlier operator wrote by merge patch move to the Apply entry (so an apply
    can release them); other managers' entries, and our status writes, stay as they are."""
    old = {"manager": "op", "operation": "Update", "fieldsV1": {"f:spec": {"f:old": {}}}}
    status = {**old, "subresource": "status", "fieldsV1": {"f:status": {}}}
    ours = {"manager": "op", "operation": "Apply", "fieldsV1": {"f:spec": {"f:new": {}}}}
    theirs = {"manager": "kubectl", "operation": "Update", "fieldsV1": {"f:spec": {"f:zz": {}}}}
    live = {"metadata": {"managedFields": [old, status, ours, theirs]}}
    upgraded = upgraded_managed_fields(live, "op")
    assert upgraded is not None
    assert status in upgraded and theirs in upgraded and old not in upgraded
    (apply,) = [e for e in upgraded if e["operation"] == "Apply"]
    assert apply["fieldsV1"] == {"f:spec": {"f:old": {}, "f:new": {}}}
    assert upgraded_managed_fields({"metadata": {"managedFields": upgraded}}, "op") is None
    assert upgraded_managed_fields(live, "someone-else") is None


def test_keyed_lists_compare_item_by_item_and_atomic_lists_whole() -> None:
    want = {"spec": {"containers": [{"name": "a", "image": "x", "args": ["--p", "1"],
                                     "env": [{"name": "A", "value": "1"}]}]}}  # fmt: skip
    live = copy.deepcopy(want)
    # A webhook's env var and sidecar beside ours, and a default the server filled in.
    live["spec"]["containers"][0]["env"].insert(0, {"name": "INJECTED", "value": "y"})
    live["spec"]["containers"].append({"name": "sidecar", "image": "mesh"})
    live["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    assert covers(live, want)
    edited = copy.deepcopy(live)
    edited["spec"]["containers"][0]["env"][1]["value"] = "2"  # ours, edited by hand
    assert not covers(edited, want)
    gone = copy.deepcopy(live)
    del gone["spec"]["containers"][0]["env"][1]
    assert not covers(gone, want)
    longer = copy.deepcopy(live)
    longer["spec"]["containers"][0]["args"].append("--x")  # args are atomic: whole
    assert not covers(longer, want)


def test_managed_fields_paths_follow_keyed_lists_and_sets() -> None:
    entry = {
        "manager": "op",
        "operation": "Apply",
        "fieldsV1": {
            "f:spec": {
                "f:containers": {
                    'k:{"name":"a"}': {".": {}, "f:image": {}},
                },
                "f:finalizers": {'v:"x"': {}},
            }
        },
    }
    live = {"metadata": {"managedFields": [entry]}}
    paths = applied_fields(live, "op")
    assert paths is not None and sorted(paths) == [
        ("f:spec", "f:containers", 'k:{"name":"a"}'),
        ("f:spec", "f:containers", 'k:{"name":"a"}', "f:image"),
        ("f:spec", "f:finalizers", 'v:"x"'),
    ]
    doc = {"spec": {"containers": [{"name": "a", "image": "i"}], "finalizers": ["x"]}}
    assert all(renders(doc, p) for p in paths)
    doc["spec"]["containers"] = [{"name": "b", "image": "i"}]
    doc["spec"]["finalizers"] = []
    assert [renders(doc, p) for p in sorted(paths)] == [False, False, False]
    assert applied_fields({"metadata": {}}, "op") is None


def test_render_command_prints_yaml_and_rejects_bad_specs(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["render", "-f", str(ROOT / "examples" / "mistral-7b-manual.yaml")]
    )
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.stdout))
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap"}
    bad = tmp_path / "bad.yaml"
    doc = services(ROOT / "examples" / "mistral-7b-manual.yaml")[0]
    doc["spec"]["engine"]["tensorParallel"] = 3
    bad.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(cli, ["render", "-f", str(bad)])
    assert result.exit_code == 1
    assert "spec.engine.tensorParallel: 3 is not one of 1, 2, 4, 8" in result.stderr


def test_the_example_redis_persists_every_write_it_takes() -> None:
    """Budgets live in it: a restart must keep them (append-only file on a volume, and no
    eviction of budget keys under memory pressure)."""
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / "redis.yaml").read_text()) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S, strict=True)
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    (isvc,) = services(ROOT / "examples" / "llama-3.1-8b-h100-autoscaling.yaml")
    store = isvc["spec"]["gateway"]["limitsStore"]
    assert store == f"redis://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:6379/0"


def test_unset_images_follow_the_operator_and_set_ones_are_pinned() -> None:
    from kvfleet_operator.gateway_spec import KVFLEET_IMAGE
    from kvfleet_operator.spec import ENGINE_IMAGE

    (doc,) = services(ROOT / "examples" / "mistral-7b-manual.yaml")

    def images(d: dict[str, Any]) -> dict[str, str]:
        objs = by_kind(render_children(owner_of(d)))["Deployment"]
        return {
            o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]["image"]
            for o in objs
        }

    assert images(doc) == {"mistral-engine": ENGINE_IMAGE, "mistral-gateway": KVFLEET_IMAGE}
    doc["spec"]["engine"]["image"] = "registry.local/sglang@sha256:abc"
    doc["spec"]["gateway"]["image"] = "registry.local/kvfleet:0.0.9"
    assert images(doc) == {
        "mistral-engine": "registry.local/sglang@sha256:abc",
        "mistral-gateway": "registry.local/kvfleet:0.0.9",
    }


OWN_IMAGE = "registry.example.com/ml-platform/kvfleet:0.2.0"


def test_unset_gateway_images_are_the_operators_own_image() -> None:
    """The operator runs the image of the chart's or an overlay's override ($KVFLEET_IMAGE):
    the gateways, their tokenizer init container and a shared gateway run it too."""
    from kvfleet_operator.render.shared_gateway import gateway_owner_of, render_shared_gateway

    (doc,) = services(ROOT / "examples" / "llama-3.1-8b-h100-autoscaling.yaml")
    doc["spec"]["gateway"]["prefixIndex"] = "events"  # the tokenizer init container too
    pod = _gateway_pod(render_children(owner_of(doc, gateway_image=OWN_IMAGE)))
    assert [c["image"] for c in pod["initContainers"] + pod["containers"]] == [OWN_IMAGE] * 2
    doc["spec"]["gateway"]["image"] = "registry.local/kvfleet:0.0.9"  # a spec's still pins
    pod = _gateway_pod(render_children(owner_of(doc, gateway_image=OWN_IMAGE)))
    assert {c["image"] for c in pod["initContainers"] + pod["containers"]} == {
        "registry.local/kvfleet:0.0.9"
    }
    shared = {"metadata": {"name": "shared", "namespace": "ai"}, "spec": {"apiKeysSecret": "k"}}
    objs = render_shared_gateway(gateway_owner_of(shared, gateway_image=OWN_IMAGE), [])
    assert _gateway_pod(objs)["containers"][0]["image"] == OWN_IMAGE


def _gateway_pod(objs: list[dict[str, Any]]) -> dict[str, Any]:
    dep = next(
        o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-gateway")
    )
    return dep["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def test_prefix_index_events_wires_engines_gateway_and_network() -> None:
    (doc,) = services(ROOT / "examples" / "llama-3.1-8b-h100-autoscaling.yaml")
    doc["spec"]["gateway"]["prefixIndex"] = "events"
    objs = render_children(owner_of(doc))
    for obj in objs:
        if obj["kind"] != "PodMonitor":
            kubernetes_validate.validate(obj, K8S, strict=True)
    engine = _engine(objs)["spec"]["template"]["spec"]["containers"][0]
    args = engine["args"]
    config = json.loads(args[args.index("--kv-events-config") + 1])
    assert config == {
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "topic": "kv-events",
    }
    assert args[args.index("--page-size") + 1] == "16"
    assert {p["name"]: p["containerPort"] for p in engine["ports"]} == {
        "http": 30000,
        "kv-events": 5557,
        "kv-replay": 5558,
    }
    # Only the gateway reaches the event ports; scrapers still reach only the HTTP port.
    np = next(o for o in objs if o["kind"] == "NetworkPolicy" and "engine" in o["metadata"]["name"])
    gateway_rule, scraper_rule = np["spec"]["ingress"]
    assert {p["port"] for p in gateway_rule["ports"]} == {30000, 5557, 5558}
    assert {p["port"] for p in scraper_rule["ports"]} == {30000}
    # The gateway hashes prompts with the model's tokenizer, fetched by an init container.
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    parsed = GatewayConfig.from_dict(yaml.safe_load(cm["data"][CONFIG_KEY]))
    assert parsed.routing.prefix_index.source == "events"
    pod = _gateway_pod(objs)
    (init,) = pod["initContainers"]
    assert init["args"][:2] == ["fetch-tokenizer", "meta-llama/Llama-3.1-8B-Instruct"]
    assert init["args"][init["args"].index("--dest") + 1] == parsed.routing.prefix_index.tokenizer
    # The engines' Hub token, for a gated model's tokenizer too.
    (token,) = [e for e in engine["env"] if e["name"] == "HF_TOKEN"]
    assert init["env"] == [token]
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts[parsed.routing.prefix_index.tokenizer]["readOnly"] is True


def test_prefix_index_events_reads_a_pvc_models_tokenizer_in_place() -> None:
    (doc,) = services(ROOT / "examples" / "mistral-7b-manual.yaml")
    doc["spec"]["model"]["source"] = {"pvc": {"claimName": "weights", "path": "mistral-7b"}}
    doc["spec"]["gateway"]["prefixIndex"] = "events"
    doc["spec"]["engine"]["pageSize"] = 32
    objs = render_children(owner_of(doc))
    args = _engine(objs)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--page-size") + 1] == "32"
    pod = _gateway_pod(objs)
    assert "initContainers" not in pod
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    parsed = GatewayConfig.from_dict(yaml.safe_load(cm["data"][CONFIG_KEY]))
    assert parsed.routing.prefix_index.tokenizer == "/models/mistral-7b"
    # A model from a URI has no tokenizer the gateway can read: refused with a reason.
    doc["spec"]["model"]["source"] = {"uri": "s3://bucket/mistral"}
    with pytest.raises(ConfigError, match="prefixIndex: events needs the model's tokenizer"):
        owner_of(doc)
    # Only the kvfleet policy reads the events: another policy with them is refused.
    doc["spec"]["model"]["source"] = {"pvc": {"claimName": "weights", "path": "mistral-7b"}}
    doc["spec"]["gateway"]["routingPolicy"] = "round_robin"
    with pytest.raises(ConfigError, match="read by the kvfleet routing policy only"):
        owner_of(doc)


# Each of these overrode the operator's value (or is unsafe) yet passed `kvfleet render`.
ABBREVIATED = [
    ["--api-ke=attacker"], ["--trust-remote-cod"], ["--model-pat=/etc"], ["--hos=0.0.0.0"],
    ["--tp-siz=8"], ["--served-model-nam", "other"], ["--por=1"], ["--tensor-parallel-size=8"],
    ["--config", "/tmp/flags.yaml"], ["--enable-custom-logit-processor"], ["--kv-events-c={}"],
]  # fmt: skip


@pytest.mark.parametrize("args", ABBREVIATED, ids=lambda a: a[0])
def test_extra_args_may_not_abbreviate_a_managed_or_forbidden_flag(
    args: list[str], tmp_path: Path
) -> None:
    """SGLang parses its flags with argparse, which takes any unambiguous prefix of a flag:
    `--api-ke=x` is `--api-key=x`. A prefix of a managed or forbidden flag is refused, with
    the same rule `kvfleet render` and the CRD (CEL) apply; other flags pass."""
    import argparse

    from kvfleet_operator.spec_argv import FORBIDDEN_FLAGS, MANAGED_FLAGS

    # What SGLang's parser does with it (allow_abbrev, its default): a managed flag is set.
    parser = argparse.ArgumentParser(exit_on_error=False)
    for flag in (*MANAGED_FLAGS, *FORBIDDEN_FLAGS, "enable-torch-compile", "log-level"):
        parser.add_argument(f"--{flag}", nargs="?", const="set")
    parsed = vars(parser.parse_args(args))
    assert any(v is not None for v in parsed.values()), parsed
    doc = services(ROOT / "examples" / "mistral-7b-manual.yaml")[0]
    doc["spec"]["engine"]["extraArgs"] = args
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(cli, ["render", "-f", str(bad)])
    assert result.exit_code == 1, result.output
    assert "spec.engine.extraArgs[0]: extraArgs may not set flags the operator manages" in (
        result.stderr
    )


def test_extra_args_that_abbreviate_nothing_managed_pass(tmp_path: Path) -> None:
    doc = services(ROOT / "examples" / "mistral-7b-manual.yaml")[0]
    doc["spec"]["engine"]["extraArgs"] = [
        "--enable-torch-compile", "--log-level=debug", "--enable-metrics-for-all-schedulers",
        "--cuda-graph-max-bs=16", "--tokenizer-path=/models/tok",
    ]  # fmt: skip
    ok = tmp_path / "ok.yaml"
    ok.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(cli, ["render", "-f", str(ok)])
    assert result.exit_code == 0, result.stderr


# Zero values a real API server keeps: pointer fields in the Go types (`*bool`, `*int32`,
# `*IntOrString`, `*EmptyDirVolumeSource`) and list elements. Any other false, 0, "", [] or
# {} is dropped when the object is stored (omitempty), so rendering it reads back as drift.
KEPT_ZERO_VALUES = {
    "Deployment.spec.strategy.rollingUpdate.maxUnavailable",
    "Deployment.spec.template.spec.containers[].securityContext.allowPrivilegeEscalation",
    "Deployment.spec.template.spec.initContainers[].securityContext.allowPrivilegeEscalation",
    "Deployment.spec.template.spec.enableServiceLinks",
    "Deployment.spec.template.spec.automountServiceAccountToken",
    "Deployment.spec.template.spec.volumes[].emptyDir",
    "Role.rules[].apiGroups[]",
}


def _zero_values(value: Any, path: str, out: list[str]) -> None:
    if isinstance(value, dict):
        if not value:
            out.append(path)
        for k, v in value.items():
            _zero_values(v, f"{path}.{k}", out)
    elif isinstance(value, list):
        if not value:
            out.append(path)
        for v in value:
            _zero_values(v, f"{path}[]", out)
    elif value is False or value == "" or (type(value) is int and value == 0):
        out.append(path)


def test_children_carry_no_zero_value_a_real_api_server_drops() -> None:
    """`publishNotReadyAddresses: false` on every engine Service, `env: []` on the tokenizer
    init container and `value: ""` in env were stored without them by a real API server, so
    every resync saw drift, patched and posted a DriftRepaired Event."""
    docs = [d for p in EXAMPLES for d in services(p)]
    single_node = next(d for d in docs if not d["spec"]["engine"].get("nodesPerReplica"))
    events = json.loads(json.dumps(single_node))
    events["spec"].setdefault("gateway", {})["prefixIndex"] = "events"
    events["spec"]["engine"]["env"] = [
        {"name": "EMPTY", "value": ""},
        {"name": "SET", "value": "1"},
    ]
    found: list[str] = []
    for doc in [*docs, events]:
        for child in render_children(owner_of(doc)):
            if child["kind"] != "LeaderWorkerSet":  # a custom resource is stored as sent
                _zero_values(child, child["kind"], found)
    assert sorted(set(found) - KEPT_ZERO_VALUES) == []
    deployment = next(
        c for c in render_children(owner_of(events)) if c["kind"] == "Deployment"
        and c["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"
    )  # fmt: skip
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "EMPTY"} in env and {"name": "SET", "value": "1"} in env


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_pods_meet_the_pod_security_standards(path: Path) -> None:
    """Every example's engine pods meet the `baseline` Pod Security Standard and every
    `restricted` rule but runAsNonRoot (the SGLang image runs as root); gateway pods (and
    their tokenizer init container) meet `restricted` whole. The checker fails on a pod that
    breaks a rule (asserted below), so a pass means something."""
    from tests.support.pod_security import baseline_violations, restricted_violations

    for doc in services(path):
        for obj in render_children(owner_of(doc)):
            if obj["kind"] != "Deployment":
                continue
            pod = obj["spec"]["template"]["spec"]
            component = obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            assert baseline_violations(pod) == [], obj["metadata"]["name"]
            allow_root = component in ("engine", "prefill")  # the SGLang image
            assert restricted_violations(pod, allow_root=allow_root) == [], obj["metadata"]["name"]
            assert all(c["resources"]["limits"].get("memory") for c in pod["containers"])
    broken = {
        "hostNetwork": True,
        "containers": [{"name": "x", "securityContext": {"privileged": True}}],
    }
    assert len(baseline_violations(broken)) == 2
    assert any("runAsNonRoot" in v for v in restricted_violations({"containers": [{"name": "x"}]}))


def test_engines_answer_only_their_gateway_with_a_key_from_a_secret() -> None:
    """SGLang's --api-key from the <isvc>-engine-key Secret (expanded by the kubelet from the
    container's env, never written into the spec); the gateway reads the same Secret as a
    file its config names; both pod templates carry the key's digest, so a new key rolls
    both. With the gateway turned off the engines keep their key and are not restarted
    (minutes of model load): whatever fronts them reads it from the Secret."""
    import base64
    import dataclasses

    (doc,) = services(ROOT / "examples" / "mistral-7b-manual.yaml")
    owner = owner_of(doc)
    objs = by_kind(render_children(owner))
    (secret,) = objs["Secret"]
    assert secret["metadata"]["name"] == "mistral-engine-key"
    assert base64.b64decode(secret["data"]["key"]).decode() == owner.engine_key
    assert len(owner.engine_key) >= 43 and owner.engine_key not in json.dumps(objs["Deployment"])
    engine, gateway = (
        next(d for d in objs["Deployment"] if d["metadata"]["name"].endswith(suffix))
        for suffix in ("-engine", "-gateway")
    )
    container = engine["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--api-key") + 1] == "$(KVFLEET_ENGINE_API_KEY)"
    (env,) = [e for e in container["env"] if e["name"] == "KVFLEET_ENGINE_API_KEY"]
    assert env["valueFrom"] == {"secretKeyRef": {"name": "mistral-engine-key", "key": "key"}}
    config = GatewayConfig.from_dict(yaml.safe_load(objs["ConfigMap"][0]["data"][CONFIG_KEY]))
    key_file = Path(str(config.backends.engine_api_key_file))
    pod = gateway["spec"]["template"]["spec"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "engine-key"]
    assert mount["mountPath"] == str(key_file.parent) and mount["readOnly"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "engine-key"]
    assert volume["secret"]["secretName"] == "mistral-engine-key" and key_file.name == "key"

    def digest(o: Any, key: str) -> str:
        d = next(
            x for x in by_kind(render_children(o))["Deployment"] if x["metadata"]["name"] == key
        )
        return str(
            d["spec"]["template"]["metadata"]["annotations"]["kvfleet.dev/engine-key-sha256"]
        )

    same = dataclasses.replace(owner)
    assert digest(same, "mistral-engine") == digest(same, "mistral-gateway")
    assert digest(owner, "mistral-engine") == digest(same, "mistral-engine")
    rotated = dataclasses.replace(owner, engine_key="another-key")
    assert digest(rotated, "mistral-engine") != digest(owner, "mistral-engine")
    assert digest(rotated, "mistral-gateway") == digest(rotated, "mistral-engine")

    doc["spec"]["gateway"] = {"enabled": False}
    bare = dataclasses.replace(owner_of(doc), engine_key=owner.engine_key)
    (alone,) = by_kind(render_children(bare))["Deployment"]
    assert [o["kind"] for o in render_children(bare)].count("Secret") == 1
    assert alone["spec"]["template"] == engine["spec"]["template"]  # no restart


def test_the_redis_password_comes_from_a_secret_never_the_spec(tmp_path: Path) -> None:
    """limitsStorePassword (a Secret key) is mounted into the gateway and named by the config
    as a file; a password in the limitsStore URL is refused (the spec and the gateway's
    ConfigMap are readable by more people than the Secret), in kvfleet render as by the CRD."""
    (doc,) = services(ROOT / "examples" / "llama-3.1-8b-h100-autoscaling.yaml")
    doc["spec"]["gateway"]["limitsStorePassword"] = {"name": "redis-auth", "key": "password"}
    objs = by_kind(render_children(owner_of(doc)))
    config = GatewayConfig.from_dict(yaml.safe_load(objs["ConfigMap"][0]["data"][CONFIG_KEY]))
    password_file = Path(str(config.limits.password_file))
    gateway = next(d for d in objs["Deployment"] if d["metadata"]["name"].endswith("-gateway"))
    pod = gateway["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "redis-password"]
    assert volume["secret"] == {
        "secretName": "redis-auth",
        "items": [{"key": "password", "path": password_file.name}],
    }
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "redis-password"]
    assert mount["mountPath"] == str(password_file.parent)
    assert "redis-auth" not in objs["ConfigMap"][0]["data"][CONFIG_KEY]
    leaky = copy.deepcopy(doc)
    store = leaky["spec"]["gateway"]["limitsStore"]
    leaky["spec"]["gateway"]["limitsStore"] = store.replace("redis://", "redis://:hunter2@")
    bad = tmp_path / "leaky.yaml"
    bad.write_text(yaml.safe_dump(leaky))
    result = CliRunner().invoke(cli, ["render", "-f", str(bad)])
    assert result.exit_code == 1
    assert "limitsStore may not carry a password" in result.stderr
