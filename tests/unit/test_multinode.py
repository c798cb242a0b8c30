"""Multi-node replicas: a service with `engine.nodesPerReplica > 1` renders LeaderWorkerSet
groups that LWS v0.9's published schema accepts, with SGLang's multi-node flags, and the
operator counts, routes and scales groups (leaders), never their workers."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from kvfleet_cli.operator_cmds import command_lines
from kvfleet_operator.render import owner_of, render_children
from kvfleet_operator.render.common import GROUP_INDEX_LABEL, ROLE_LABEL, WORKER_INDEX_LABEL
from kvfleet_operator.replicas import removable_groups
from kvfleet_operator.scaling.autoscaler import Scaled
from kvfleet_operator.scaling.model import Decision
from tests.support.leaderworkerset import schema_problems
from tests.support.objects import example, isvc

K8S = "1.31.0"


def _deepseek() -> dict[str, Any]:
    (doc,) = [d for d in example("deepseek-v3-2x8-h100.yaml") if d["kind"] == "InferenceService"]
    doc["metadata"]["uid"] = "5f0c2b9e-0000-4000-8000-000000000002"
    return doc


def _with_uid(doc: dict[str, Any]) -> dict[str, Any]:
    doc["metadata"]["uid"] = "5f0c2b9e-0000-4000-8000-000000000003"
    return doc


def _children(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in render_children(owner_of(doc))}


def test_a_multi_node_replica_is_a_leader_worker_set_group() -> None:
    objs = _children(_deepseek())
    assert ("Deployment", "deepseek-v3-engine") not in objs  # the engine is not a Deployment
    lws = objs[("LeaderWorkerSet", "deepseek-v3-engine")]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert spec["replicas"] == 1 and spec["startupPolicy"] == "LeaderCreated"
    group = spec["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    # Only leaders carry the role the gateway selects on.
    assert ROLE_LABEL in leader["metadata"]["labels"]
    assert ROLE_LABEL not in worker["metadata"]["labels"]
    for template in (leader, worker):
        (c,) = template["spec"]["containers"]
        args = " ".join(c["args"])
        for flag in ("--tp-size 16", "--nnodes 2", "--node-rank $(LWS_WORKER_INDEX)",
                     "--dist-init-addr $(LWS_LEADER_ADDRESS):20000"):  # fmt: skip
            assert flag in args, (flag, args)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"  # one node's GPUs per pod
        assert {"name": "dist-init", "containerPort": 20000, "protocol": "TCP"} in c["ports"]
    # The group's pods find their leader through the engine Service before it is ready.
    svc = objs[("Service", "deepseek-v3-engine")]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert spec["networkConfig"] == {"subdomainPolicy": "Shared"}


def test_the_leader_worker_set_is_what_lws_v0_9_accepts_and_keeps() -> None:
    lws = _children(_deepseek())[("LeaderWorkerSet", "deepseek-v3-engine")]
    errors, pruned = schema_problems(lws)
    assert errors == [] and pruned == [], (errors, pruned)
    for role in ("leaderTemplate", "workerTemplate"):  # each a valid pod of Kubernetes 1.31
        template = lws["spec"]["leaderWorkerTemplate"][role]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, **template}
        pod["metadata"] = {**template["metadata"], "name": "p"}
        kubernetes_validate.validate(pod, K8S, strict=True)


def test_gateway_monitoring_and_network_policy_see_groups() -> None:
    objs = _children(_deepseek())
    config = objs[("ConfigMap", "deepseek-v3-gateway")]["data"]["gateway.yaml"]
    assert f"{WORKER_INDEX_LABEL}=0,{ROLE_LABEL}=active" in config  # leaders only
    monitor = objs[("PodMonitor", "deepseek-v3-engine")]["spec"]["selector"]["matchLabels"]
    assert monitor[WORKER_INDEX_LABEL] == "0"
    policy = objs[("NetworkPolicy", "deepseek-v3-engine")]["spec"]["ingress"]
    labels = {
        "kvfleet.dev/inferenceservice": "deepseek-v3",
        "app.kubernetes.io/component": "engine",
    }
    engines = {"podSelector": {"matchLabels": labels}}
    assert {"from": [engines]} in policy  # the group's own pods, any port (NCCL picks them)


def test_single_node_services_render_as_before() -> None:
    objs = _children(_with_uid(isvc("plain")))
    assert ("Deployment", "plain-engine") in objs
    assert not any(kind == "LeaderWorkerSet" for kind, _ in objs)
    svc = objs[("Service", "plain-engine")]
    assert "publishNotReadyAddresses" not in svc["spec"]
    args = objs[("Deployment", "plain-engine")]["spec"]["template"]["spec"]["containers"][0]
    assert "--nnodes" not in args["args"]


def test_pipeline_parallel_splits_the_groups_gpus() -> None:
    doc = _deepseek()
    doc["spec"]["engine"]["pipelineParallel"] = 2
    lws = _children(doc)[("LeaderWorkerSet", "deepseek-v3-engine")]
    args = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["args"]
    assert args[args.index("--tp-size") + 1] == "8" and args[args.index("--pp-size") + 1] == "2"


def test_render_check_expands_what_the_kubelet_expands() -> None:
    leader, worker = command_lines(owner_of(_deepseek()))
    for rank, line in enumerate((leader, worker)):
        assert line[line.index("--node-rank") + 1] == str(rank)
        addr = line[line.index("--dist-init-addr") + 1]
        assert addr == "deepseek-v3-engine-0.deepseek-v3-engine.ai:20000"
        assert not any("$(" in a for a in line)
    assert len(command_lines(owner_of(_with_uid(isvc("plain"))))) == 1


def _leader(group: int, role: str, ready: bool = True) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"svc-engine-{group}",
            "labels": {GROUP_INDEX_LABEL: str(group), WORKER_INDEX_LABEL: "0", ROLE_LABEL: role},
        },
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


IDLE_1_2 = {"svc-engine-1", "svc-engine-2"}


@pytest.mark.parametrize(
    ("leaders", "idle", "removable"),
    [
        # Scale-down removes the highest groups: they go only while each is idle warm or
        # not ready; an active or busy group stops the count. A missing leader (its group
        # being recreated) may go.
        ([_leader(0, "active"), _leader(1, "warm"), _leader(2, "warm")], IDLE_1_2, 2),
        ([_leader(0, "active"), _leader(1, "warm"), _leader(2, "warm")], {"svc-engine-1"}, 0),
        ([_leader(0, "active"), _leader(1, "active"), _leader(2, "warm", False)], set(), 1),
        ([_leader(0, "active"), _leader(2, "warm")], {"svc-engine-2"}, 2),
    ],
)
def test_scale_down_removes_only_idle_top_groups(
    leaders: list[dict[str, Any]], idle: set[str], removable: int
) -> None:
    decision = Decision(desired_active=1, desired_warm=0, reason="test")
    scaled = Scaled(
        decision, at=0.0, source="direct", cold_start_s=60.0, in_flight=dict.fromkeys(idle, 0.0)
    )
    assert removable_groups(leaders, scaled, have=3) == removable
