"""The emulated API server over HTTP: the semantics real clients (kubernetes, kopf, kubectl)
rely on, asserted at the protocol boundary."""

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvfleet_localcluster.apiserver import ClusterAPI
from kvfleet_localcluster.emulated import EmulatedCluster
from tests.support.emulated import emulated_cluster_config as cluster_config

POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "p1", "labels": {"app": "engine", "tier": "gpu"}},
    "spec": {
        "containers": [
            {"name": "engine", "image": "kvfleet:1", "env": [{"name": "A", "value": "1"}]}
        ]
    },
}


class Api:
    def __init__(
        self, url: str, session: aiohttp.ClientSession, server: ClusterAPI, cluster: EmulatedCluster
    ) -> None:
        self.url, self.s, self.server, self.cluster = url, session, server, cluster

    def client_configuration(self) -> Any:
        """The official client, logged in with the cluster's kubeconfig."""
        from kvfleet_operator.login import Credentials, client_configuration

        return client_configuration(Credentials(kubeconfig=str(self.cluster.kubeconfig)))

    async def __call__(
        self, method: str, path: str, body: Any = None, ctype: str = "application/json"
    ) -> tuple[int, Any]:
        data = None if body is None else (body if isinstance(body, str) else json.dumps(body))
        async with self.s.request(
            method, self.url + path, data=data, headers={"Content-Type": ctype}
        ) as r:
            text = await r.text()
            return r.status, json.loads(text) if text.startswith("{") else text


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    """The local cluster's API server alone (no controllers: nothing writes but the test)."""
    async with (
        EmulatedCluster(cluster_config(tmp_path, controllers=False, crds=False)) as cluster,
        cluster.session() as session,
    ):
        yield Api(cluster.url, session, cluster.api, cluster)


async def test_create_sets_metadata_and_conflicts(api: Api) -> None:
    status, pod = await api("POST", "/api/v1/namespaces/ai/pods", POD)
    assert status == 201
    meta = pod["metadata"]
    assert meta["uid"] and meta["creationTimestamp"] and meta["generation"] == 1
    assert meta["namespace"] == "ai" and int(meta["resourceVersion"]) > 0
    status, err = await api("POST", "/api/v1/namespaces/ai/pods", POD)
    assert status == 409 and err["reason"] == "AlreadyExists" and err["kind"] == "Status"
    status, gen = await api(
        "POST", "/api/v1/namespaces/ai/pods", {"metadata": {"generateName": "engine-"}, "spec": {}}
    )
    assert status == 201 and gen["metadata"]["name"].startswith("engine-")
    assert (await api("GET", "/api/v1/namespaces/ai/pods/nope"))[0] == 404


async def test_replace_generation_and_stale_versions(api: Api) -> None:
    _, pod = await api("POST", "/api/v1/namespaces/ai/pods", POD)
    stale = pod["metadata"]["resourceVersion"]
    pod["metadata"]["labels"]["extra"] = "x"
    status, same_spec = await api("PUT", "/api/v1/namespaces/ai/pods/p1", pod)
    assert status == 200 and same_spec["metadata"]["generation"] == 1  # labels only
    pod["spec"]["containers"][0]["image"] = "kvfleet:2"
    status, _ = await api("PUT", "/api/v1/namespaces/ai/pods/p1", pod)
    assert status == 409  # pod still carries the old resourceVersion
    pod["metadata"]["resourceVersion"] = same_spec["metadata"]["resourceVersion"]
    status, new = await api("PUT", "/api/v1/namespaces/ai/pods/p1", pod)
    assert status == 200 and new["metadata"]["generation"] == 2
    assert int(new["metadata"]["resourceVersion"]) > int(stale)


async def test_status_and_spec_are_separate(api: Api) -> None:
    await api("POST", "/api/v1/namespaces/ai/pods", POD)
    status, pod = await api(
        "PATCH",
        "/api/v1/namespaces/ai/pods/p1/status",
        {"status": {"phase": "Running"}, "spec": {"nodeName": "evil"}},
        "application/merge-patch+json",
    )
    assert status == 200 and pod["status"] == {"phase": "Running"}
    assert "nodeName" not in pod["spec"]
    _, pod = await api(
        "PATCH",
        "/api/v1/namespaces/ai/pods/p1",
        {"status": {"phase": "Failed"}, "spec": {"nodeName": "n1"}},
        "application/merge-patch+json",
    )
    assert pod["status"] == {"phase": "Running"} and pod["spec"]["nodeName"] == "n1"


async def test_patch_types(api: Api) -> None:
    _, pod = await api("POST", "/api/v1/namespaces/ai/pods", POD)
    rv = pod["metadata"]["resourceVersion"]
    # JSON patch with a failed test: 422, nothing changes (kopf relies on this)
    status, _ = await api(
        "PATCH",
        "/api/v1/namespaces/ai/pods/p1",
        [
            {"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
            {"op": "add", "path": "/metadata/labels/x", "value": "y"},
        ],
        "application/json-patch+json",
    )
    assert status == 422
    status, pod = await api(
        "PATCH",
        "/api/v1/namespaces/ai/pods/p1",
        [
            {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
            {"op": "add", "path": "/metadata/labels/x", "value": "y"},
        ],
        "application/json-patch+json",
    )
    assert status == 200 and pod["metadata"]["labels"]["x"] == "y"
    # strategic merge: containers and env merge by name
    _, pod = await api(
        "PATCH",
        "/api/v1/namespaces/ai/pods/p1",
        {
            "spec": {
                "containers": [
                    {"name": "engine", "env": [{"name": "B", "value": "2"}]},
                    {"name": "sidecar", "image": "s"},
                ]
            }
        },
        "application/strategic-merge-patch+json",
    )
    engine = pod["spec"]["containers"][0]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["engine", "sidecar"]
    assert engine["image"] == "kvfleet:1" and [e["name"] for e in engine["env"]] == ["A", "B"]
    # merge patch: null deletes; lists replace
    _, pod = await api(
        "PATCH",
        "/api/v1/namespaces/ai/pods/p1",
        {"metadata": {"labels": {"tier": None}}},
        "application/merge-patch+json",
    )
    assert "tier" not in pod["metadata"]["labels"]
    # server-side apply (single manager): YAML body, merged
    status, pod = await api(
        "PATCH",
        "/api/v1/namespaces/ai/pods/p1?fieldManager=me",
        "metadata:\n  annotations:\n    a: b\n",
        "application/apply-patch+yaml",
    )
    assert status == 200 and pod["metadata"]["annotations"] == {"a": "b"}


async def test_selectors_on_list(api: Api) -> None:
    for name, labels in (
        ("a", {"app": "engine", "role": "active"}),
        ("b", {"app": "engine", "role": "warm"}),
        ("c", {"app": "gw"}),
    ):
        await api(
            "POST", "/api/v1/namespaces/ai/pods", {"metadata": {"name": name, "labels": labels}}
        )
    await api(
        "PATCH",
        "/api/v1/namespaces/ai/pods/a/status",
        {"status": {"phase": "Running"}},
        "application/merge-patch+json",
    )

    async def names(query: str) -> list[str]:
        status, body = await api("GET", f"/api/v1/namespaces/ai/pods?{query}")
        assert status == 200
        return [p["metadata"]["name"] for p in body["items"]]

    assert await names("labelSelector=app%3Dengine") == ["a", "b"]
    assert await names("labelSelector=app%3Dengine,role!%3Dwarm") == ["a"]
    assert await names("labelSelector=role%20in%20(active,warm)") == ["a", "b"]
    assert await names("labelSelector=!role") == ["c"]
    assert await names("fieldSelector=status.phase%3DRunning") == ["a"]
    assert await names("fieldSelector=metadata.name%3Dc") == ["c"]
    assert (await api("GET", "/api/v1/namespaces/ai/pods?labelSelector=a%20b%20c"))[0] == 400


async def test_watch_resumes_from_resource_version_and_times_out(api: Api) -> None:
    _, first = await api("POST", "/api/v1/namespaces/ai/pods", POD)
    rv = first["metadata"]["resourceVersion"]
    await api(
        "POST",
        "/api/v1/namespaces/ai/pods",
        {"metadata": {"name": "other", "labels": {"app": "x"}}},
    )

    async def watch(query: str) -> list[tuple[str, str]]:
        events = []
        async with api.s.get(f"{api.url}/api/v1/namespaces/ai/pods?watch=true&{query}") as r:
            async for line in r.content:
                if line.strip():
                    e = json.loads(line)
                    events.append((e["type"], e["object"]["metadata"]["name"]))
        return events

    task = asyncio.create_task(
        watch(f"resourceVersion={rv}&timeoutSeconds=1&labelSelector=app%3Dengine")
    )
    await asyncio.sleep(0.2)
    await api(
        "PATCH",
        "/api/v1/namespaces/ai/pods/p1",
        {"metadata": {"labels": {"v": "2"}}},
        "application/merge-patch+json",
    )
    await api("DELETE", "/api/v1/namespaces/ai/pods/p1")
    events = await asyncio.wait_for(task, 5)  # ends by itself at timeoutSeconds
    assert events == [("MODIFIED", "p1"), ("DELETED", "p1")]  # no replay, no foreign pod


async def test_too_old_resource_version_is_410(api: Api) -> None:
    api.server.store.history_size = 3
    for i in range(6):
        await api("POST", "/api/v1/namespaces/ai/pods", {"metadata": {"name": f"p{i}"}})
    async with api.s.get(
        f"{api.url}/api/v1/namespaces/ai/pods?watch=true&resourceVersion=1&timeoutSeconds=1"
    ) as r:
        first = json.loads(await r.content.readline())
    assert first["type"] == "ERROR" and first["object"]["code"] == 410


async def test_scale_subresource_on_deployments(api: Api) -> None:
    dep = {
        "metadata": {"name": "engine"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "engine"}},
            "template": {"metadata": {"labels": {"app": "engine"}}, "spec": {}},
        },
    }
    assert (await api("POST", "/apis/apps/v1/namespaces/ai/deployments", dep))[0] == 201
    status, scale = await api("GET", "/apis/apps/v1/namespaces/ai/deployments/engine/scale")
    assert status == 200 and scale["kind"] == "Scale" and scale["spec"]["replicas"] == 2
    assert scale["status"]["selector"] == "app=engine"
    status, scale = await api(
        "PATCH",
        "/apis/apps/v1/namespaces/ai/deployments/engine/scale",
        {"spec": {"replicas": 5}},
        "application/merge-patch+json",
    )
    assert status == 200 and scale["spec"]["replicas"] == 5
    _, dep = await api("GET", "/apis/apps/v1/namespaces/ai/deployments/engine")
    assert dep["spec"]["replicas"] == 5 and dep["metadata"]["generation"] == 2


async def test_owner_garbage_collection_and_finalizers(api: Api) -> None:
    _, owner = await api("POST", "/api/v1/namespaces/ai/configmaps", {"metadata": {"name": "o"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "o", "uid": owner["metadata"]["uid"]}
    await api(
        "POST",
        "/api/v1/namespaces/ai/pods",
        {"metadata": {"name": "child", "ownerReferences": [ref]}},
    )
    await api(
        "POST",
        "/api/v1/namespaces/ai/pods",
        {"metadata": {"name": "held", "ownerReferences": [ref], "finalizers": ["x/y"]}},
    )
    await api("DELETE", "/api/v1/namespaces/ai/configmaps/o")
    assert (await api("GET", "/api/v1/namespaces/ai/pods/child"))[0] == 404
    status, held = await api("GET", "/api/v1/namespaces/ai/pods/held")
    assert status == 200 and held["metadata"]["deletionTimestamp"]  # waits for its finalizer
    await api(
        "PATCH",
        "/api/v1/namespaces/ai/pods/held",
        {"metadata": {"finalizers": None}},
        "application/merge-patch+json",
    )
    assert (await api("GET", "/api/v1/namespaces/ai/pods/held"))[0] == 404


async def test_namespaces_and_crds_become_servable(api: Api) -> None:
    assert (await api("POST", "/api/v1/namespaces", {"metadata": {"name": "ai"}}))[0] == 201
    status, nss = await api("GET", "/api/v1/namespaces")
    assert status == 200 and [n["metadata"]["name"] for n in nss["items"]] == ["ai"]
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "inferenceservices.kvfleet.dev"},
        "spec": {
            "group": "kvfleet.dev",
            "scope": "Namespaced",
            "names": {
                "plural": "inferenceservices",
                "singular": "inferenceservice",
                "kind": "InferenceService",
                "shortNames": ["kis"],
            },
            "versions": [
                {
                    "name": "v1alpha1",
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                }
            ],
        },
    }
    assert (await api("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd))[
        0
    ] == 201
    base = "/apis/kvfleet.dev/v1alpha1/namespaces/ai/inferenceservices"
    status, isvc = await api(
        "POST", base, {"metadata": {"name": "llama"}, "spec": {"model": "m", "replicas": 1}}
    )
    assert status == 201 and isvc["kind"] == "InferenceService"
    status, scale = await api(
        "PATCH", f"{base}/llama/scale", {"spec": {"replicas": 3}}, "application/merge-patch+json"
    )
    assert status == 200 and scale["spec"]["replicas"] == 3
    status, discovery = await api("GET", "/apis/kvfleet.dev/v1alpha1")
    assert status == 200 and "inferenceservices" in json.dumps(discovery)


async def test_the_real_kubernetes_client(api: Api) -> None:
    """The official client (sync) sees a real server: 201 bodies, selectors, scale, conflicts."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    cfg = api.client_configuration()

    def scenario() -> None:
        with client.ApiClient(cfg) as c:
            core, apps = client.CoreV1Api(c), client.AppsV1Api(c)
            created = core.create_namespaced_pod(
                "ai",
                client.V1Pod(
                    metadata=client.V1ObjectMeta(name="p", labels={"app": "engine"}),
                    spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="i")]),
                ),
            )
            assert created is not None and created.metadata.uid  # 201 with the object
            listed = core.list_namespaced_pod("ai", label_selector="app=engine")
            assert [p.metadata.name for p in listed.items] == ["p"]
            assert core.list_namespaced_pod("ai", label_selector="app=other").items == []
            with pytest.raises(ApiException) as err:
                core.create_namespaced_pod("ai", created)
            assert err.value.status == 409
            apps.create_namespaced_deployment(
                "ai",
                client.V1Deployment(
                    metadata=client.V1ObjectMeta(name="d"),
                    spec=client.V1DeploymentSpec(
                        replicas=1,
                        selector=client.V1LabelSelector(match_labels={"app": "e"}),
                        template=client.V1PodTemplateSpec(
                            metadata=client.V1ObjectMeta(labels={"app": "e"}),
                            spec=client.V1PodSpec(
                                containers=[client.V1Container(name="c", image="i")]
                            ),
                        ),
                    ),
                ),
            )
            apps.patch_namespaced_deployment_scale("d", "ai", {"spec": {"replicas": 4}})
            assert apps.read_namespaced_deployment("d", "ai").spec.replicas == 4
            core.delete_namespaced_pod("p", "ai")
            with pytest.raises(ApiException) as err:
                core.read_namespaced_pod("p", "ai")
            assert err.value.status == 404

    await asyncio.to_thread(scenario)


async def test_core_discovery_names_its_group_version(api: Api) -> None:
    status, doc = await api("GET", "/api/v1")
    assert status == 200 and doc["groupVersion"] == "v1"
    assert "pods" in {r["name"] for r in doc["resources"]}
    status, apis = await api("GET", "/apis")
    assert "metrics.k8s.io" not in json.dumps(apis)  # no metrics-server here


async def test_a_dependent_of_a_deleted_owner_is_collected(api: Api) -> None:
    """A child created just after its owner was deleted (an operator racing the deletion)
    is garbage-collected, as Kubernetes' garbage collector does; the create still succeeds."""
    status, owner = await api(
        "POST", "/api/v1/namespaces/ai/configmaps", {"metadata": {"name": "o"}}
    )
    assert status == 201
    assert (await api("DELETE", "/api/v1/namespaces/ai/configmaps/o"))[0] == 200
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "o", "uid": owner["metadata"]["uid"]}
    child = {"metadata": {"name": "child", "ownerReferences": [ref]}}
    assert (await api("POST", "/api/v1/namespaces/ai/configmaps", child))[0] == 201
    assert (await api("GET", "/api/v1/namespaces/ai/configmaps/child"))[0] == 404


async def test_managed_fields_sent_with_a_write(api: Api) -> None:
    """As a real server: managedFields sent with a write replace the stored ones (how a
    controller moves its Update entry to its Apply entry), `[{}]` clears them, and an empty
    list leaves them (a client unaware of the field cannot strip it)."""
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"a": "1"}}
    path = "/api/v1/namespaces/ai/configmaps/c"
    status, created = await api("POST", "/api/v1/namespaces/ai/configmaps?fieldManager=op", cm)
    assert status == 201
    (entry,) = created["metadata"]["managedFields"]
    assert (entry["manager"], entry["operation"]) == ("op", "Update")

    def managers(obj: Any) -> set[tuple[str, str]]:
        return {(e["manager"], e["operation"]) for e in obj["metadata"].get("managedFields", [])}

    empty = {"metadata": {"managedFields": []}}
    status, kept = await api("PATCH", path, empty, "application/merge-patch+json")
    assert status == 200 and managers(kept) == {("op", "Update")}
    moved = [{**entry, "operation": "Apply"}]
    ops = [
        {
            "op": "test",
            "path": "/metadata/resourceVersion",
            "value": kept["metadata"]["resourceVersion"],
        },
        {"op": "replace", "path": "/metadata/managedFields", "value": moved},
    ]
    status, replaced = await api(
        "PATCH", path + "?fieldManager=op", ops, "application/json-patch+json"
    )
    assert status == 200 and managers(replaced) == {("op", "Apply")}
    # The Apply entry now owns data.a: an apply without it removes it.
    apply = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"b": "2"}}
    status, applied = await api(
        "PATCH", path + "?fieldManager=op&force=true", apply, "application/apply-patch+yaml"
    )
    assert status == 200 and applied["data"] == {"b": "2"}, applied
    clear = {"metadata": {"managedFields": [{}]}}
    status, cleared = await api("PATCH", path, clear, "application/merge-patch+json")
    assert status == 200 and "managedFields" not in cleared["metadata"], cleared["metadata"]
