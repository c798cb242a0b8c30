"""Built-in kinds as kube-apiserver decodes and encodes them (the local cluster's
`builtin_fields`): unknown fields at every depth, and zero values of `omitempty` fields
(rules generated from kubernetes/api's Go types at the cluster's version)."""

from __future__ import annotations

import json
from importlib import resources

from kvfleet_localcluster.builtin_fields import (
    CLUSTER_VERSION,
    drop_omitted,
    drop_unknown_fields,
)


def deployment() -> dict:  # type: ignore[type-arg]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "labels": {}, "annotations": {"a": ""}},
        "spec": {
            "replicas": 0,
            "paused": False,
            "selector": {"matchLabels": {"app": "d"}},
            "template": {
                "metadata": {"labels": {"app": "d"}},
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "image": "i",
                            "env": [{"name": "A", "value": ""}, {"name": "B", "value": "b"}],
                            "ports": [],
                            "resources": {"limits": {"cpu": "1"}},
                            "securityContext": {"privileged": False},
                            "imagePullPolicyy": "Always",
                        }
                    ],
                    "hostNetwork": False,
                },
            },
        },
        "status": {"replicas": 0, "readyReplicas": 2, "conditions": []},
    }


def test_omitempty_zero_values_are_dropped_as_the_encoder_drops_them() -> None:
    d = deployment()
    drop_omitted("apps", "v1", "Deployment", d)
    assert "labels" not in d["metadata"]  # empty map
    assert d["metadata"]["annotations"] == {"a": ""}  # a map's values are not fields
    assert d["spec"]["replicas"] == 0  # *int32: only null is omitted
    assert "paused" not in d["spec"]  # bool false
    pod = d["spec"]["template"]["spec"]
    assert "hostNetwork" not in pod
    c = pod["containers"][0]
    assert c["env"] == [{"name": "A"}, {"name": "B", "value": "b"}]  # "" value left out
    assert "ports" not in c  # empty list
    assert c["securityContext"] == {"privileged": False}  # *bool false is kept
    assert c["resources"] == {"limits": {"cpu": "1"}}
    assert d["status"] == {"readyReplicas": 2}  # replicas 0 and conditions [] go


def test_unknown_fields_are_found_at_every_depth_and_dropped() -> None:
    d = deployment()
    assert drop_unknown_fields("apps", "v1", "Deployment", d) == [
        "spec.template.spec.containers[0].imagePullPolicyy"
    ]
    assert "imagePullPolicyy" not in d["spec"]["template"]["spec"]["containers"][0]
    assert drop_unknown_fields("apps", "v1", "Deployment", d) == []
    assert drop_unknown_fields("example.com", "v1", "Widget", {"spec": {"x": 1}}) == []


def test_the_rules_name_the_kubernetes_release_they_came_from() -> None:
    data = resources.files("kvfleet_localcluster") / "data" / f"omitempty-v{CLUSTER_VERSION}.json"
    doc = json.loads(data.read_text())
    assert doc["source"].endswith(f"at v0.{CLUSTER_VERSION.split('.', 1)[1]}, json omitempty tags")
    assert (
        doc["definitions"]["io.k8s.api.core.v1.ServiceSpec"]["publishNotReadyAddresses"] == "zero"
    )
