"""The CRDs in `crds/` as the real API server takes them: each one accepted (its structural
schema, every CEL rule compiled within the cost budgets — a real server refuses a CRD over
budget), and InferenceServices admitted the way the CRD says: defaults filled in, unknown
fields pruned (or refused under strict field validation), types and bounds checked, CEL
rules enforced — on create, on patch, and on `/scale` (which cannot set replicas on an
autoscaled service)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp
import yaml

from kvfleet_bench.spec_cost import CASES
from tests.support.cluster import Env
from tests.support.objects import ROOT
from tests.support.objects import isvc as make_isvc

MERGE = {"Content-Type": "application/merge-patch+json"}
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
NAMESPACE = "default"
"""Namespace of the HOSTILE objects (another file posts them as they are)."""


def isvc(name: str, **spec: Any) -> dict[str, Any]:
    return make_isvc(name, namespace=NAMESPACE, **spec)


MODEL = {"name": "llama-3.1-8b", "source": {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"}}
LORA = {"maxLoraRank": 16, "targetModules": ["q_proj"]}
ADAPTER = {"name": "sql", "source": {"huggingFace": "org/sql"}}
UP_AND_OUT = {"pvc": {"claimName": "m", "path": ".."}}
HOSTILE = [
    # A name that would stand for another service's adapter on a shared gateway.
    (isvc("h1", model={**MODEL, "aliases": ["llama-3.1-8b:sql"]}), "spec.model.aliases[0]"),
    # A price that would be budget credit.
    (
        isvc("h2", model={**MODEL, "price": {"prompt": 1, "cached": -1e6, "output": 1}}),
        "spec.model.price.cached: Invalid value",
    ),
    # Values rendered into the engine's argv, env or a kubelet expansion.
    (
        isvc("h3", lora={**LORA, "targetModules": ["q_proj", "--enable-custom-logit-processor"]}),
        "spec.lora.targetModules[1]: Invalid value",
    ),
    (isvc("h4", model={**MODEL, "revision": "$(KVFLEET_ENGINE_API_KEY)"}), "spec.model.revision"),
    (
        isvc("h5", model={**MODEL, "source": {"uri": "s3://b/$(KVFLEET_ENGINE_API_KEY)"}}),
        "spec.model.source.uri: Invalid value",
    ),
    (
        isvc("h6", engine={"env": [{"name": "KVFLEET_ENGINE_API_KEY", "value": "x"}]}),
        "env KVFLEET_ENGINE_API_KEY is set by the operator",
    ),
    (isvc("h7", engine={"extraArgs": ["--trust-remote-cod"]}), "spec.engine.extraArgs"),
    (isvc("h8", engine={"extraArgs": ["--lora-paths", "x=org/x"]}), "spec.engine.extraArgs"),
    # A path that climbs out of the claim it is mounted from.
    (
        isvc("h10", model={**MODEL, "source": {"pvc": {"claimName": "m", "path": "a/../../x"}}}),
        "spec.model.source.pvc.path: Invalid value",
    ),
    (
        isvc("h11", lora={**LORA, "adapters": [{"name": "up", "source": UP_AND_OUT}]}),
        "path must stay inside the claim",
    ),
    # Uniqueness as a list-type map: the API server checks it in one pass.
    (
        isvc(
            "h9", lora={**LORA, "adapters": [ADAPTER, {**ADAPTER, "source": {"uri": "s3://b/c"}}]}
        ),
        "spec.lora.adapters[1]: Duplicate value",
    ),
]
INVALID = [
    (
        isvc("a", replicas=2, autoscaling={"maxReplicas": 3}),
        "replicas and autoscaling are mutually exclusive",
    ),
    (isvc("b", engine={"tensorParallel": 3}), "spec.engine.tensorParallel: Unsupported value: 3"),
    (isvc("c", engine={"extraArgs": ["--port=1"]}), "spec.engine.extraArgs[0]: Invalid value"),
    (  # an abbreviation SGLang's parser takes for --api-key
        isvc("c2", engine={"extraArgs": ["--api-ke=attacker"]}),
        "spec.engine.extraArgs[0]: Invalid value",
    ),
    (isvc("d", replicas="two"), "spec.replicas in body must be of type integer"),
    # Every child name must fit: '-engine' on a Service name of at most 63 characters.
    (isvc("a" * 57), "metadata.name: Invalid value"),
    (isvc("7b-model"), "metadata.name: Invalid value"),
    (isvc("e", autoscaling={"minReplicas": 5, "maxReplicas": 2}), "spec.autoscaling.minReplicas"),
    ({**isvc("f"), "spec": {"gateway": {"insecureNoAuth": True}}}, "spec.model: Required value"),
    *HOSTILE,
]


async def call(
    s: aiohttp.ClientSession, method: str, url: str, body: Any, **kw: Any
) -> tuple[int, Any, Mapping[str, str]]:
    async with s.request(method, url, json=body, **kw) as r:
        return r.status, json.loads(await r.text() or "{}"), r.headers


def crd_files() -> dict[str, dict[str, Any]]:
    """The CRDs of `crds/` by name (the kustomization beside them is not one)."""
    paths = sorted((ROOT / "crds").glob("*.yaml"))
    docs = [d for p in paths for d in yaml.safe_load_all(p.read_text()) if d]
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "CustomResourceDefinition"}


def renamed(crd: dict[str, Any], group: str) -> dict[str, Any]:
    """The same CRD under another group: a create of its own, not an update of ours."""
    spec = {**crd["spec"], "group": group}
    name = f"{spec['names']['plural']}.{group}"
    return {**crd, "metadata": {**crd["metadata"], "name": name}, "spec": spec}


async def test_every_crd_is_accepted_by_the_real_api_server(local_cluster: Env) -> None:
    """Each CRD in `crds/` (all that the kustomization installs) is on the server as
    written, Established with its names accepted; and a dry-run create of each (under
    another group) passes strict field validation without a warning. A create is judged in
    full, each CEL rule's estimated cost included; an update would let a rule that was
    already there keep a cost over the budget."""
    crds = crd_files()
    kustomized = yaml.safe_load((ROOT / "crds" / "kustomization.yaml").read_text())["resources"]
    assert len(crds) == len(kustomized) == 2, (sorted(crds), kustomized)
    cluster = local_cluster.cluster
    async with cluster.session() as s:
        for name, crd in crds.items():
            status, live, _ = await call(s, "GET", f"{cluster.url}{CRDS}/{name}", None)
            assert status == 200, live
            conditions = {c["type"]: c["status"] for c in live["status"]["conditions"]}
            assert conditions["Established"] == conditions["NamesAccepted"] == "True", conditions
            for want, got in zip(crd["spec"]["versions"], live["spec"]["versions"], strict=True):
                assert got["schema"] == want["schema"], f"{name} {want['name']}: schema changed"
                assert got.get("additionalPrinterColumns") == want.get("additionalPrinterColumns")
            url = f"{cluster.url}{CRDS}?dryRun=All&fieldValidation=Strict"
            status, body, headers = await call(s, "POST", url, renamed(crd, "check.kvfleet.dev"))
            assert status == 201, (name, body.get("message"))
            assert "Warning" not in headers, (name, headers.get("Warning"))


async def test_defaults_pruning_and_rules(local_cluster: Env) -> None:
    cluster, ns = local_cluster.cluster, local_cluster.ns
    isvcs = f"{cluster.url}/apis/kvfleet.dev/v1alpha1/namespaces/{ns}/inferenceservices"

    def here(obj: dict[str, Any]) -> dict[str, Any]:
        return {**obj, "metadata": {**obj["metadata"], "namespace": ns}}

    async with cluster.session() as s:
        body = here(isvc("ok", replicas=2, notAField=1))
        # Strict field validation (kubectl's default) refuses the unknown field (400) ...
        status, refused, _ = await call(s, "POST", isvcs + "?fieldValidation=Strict", body)
        assert status == 400 and 'unknown field "spec.notAField"' in refused["message"], refused
        # ... the API's default prunes it and says so in a warning.
        status, created, headers = await call(s, "POST", isvcs, body)
        assert status == 201, created
        assert headers.get("Warning") == r'299 - "unknown field \"spec.notAField\""', headers
        spec = created["spec"]
        assert "notAField" not in spec
        assert spec["engine"]["tensorParallel"] == 1  # defaults from the schema
        # Images are not defaulted at admission: an unset image follows the operator's
        # release, so upgrading the operator moves the data plane (a default would freeze it).
        assert "image" not in spec["engine"] and "image" not in spec["gateway"]
        assert spec["gateway"]["routingPolicy"] == "kvfleet"

        for obj, message in INVALID:
            status, answer, _ = await call(s, "POST", isvcs, here(obj))
            assert status == 422, obj
            assert message in answer["message"], (obj["metadata"]["name"], answer["message"])

        # Updates are admitted the same way; /scale writes spec.replicas through the rules.
        patch = {"spec": {"engine": {"tensorParallel": 5}}}
        status, _, _ = await call(s, "PATCH", f"{isvcs}/ok", patch, headers=MERGE)
        assert status == 422
        auto = here(isvc("auto", autoscaling={"minReplicas": 1, "maxReplicas": 4}))
        status, _, _ = await call(s, "POST", isvcs, auto)
        assert status == 201
        scale = {"spec": {"replicas": 3}}
        status, answer, _ = await call(s, "PATCH", f"{isvcs}/auto/scale", scale, headers=MERGE)
        assert status == 422 and "mutually exclusive" in answer["message"], answer
        status, answer, _ = await call(s, "PATCH", f"{isvcs}/ok/scale", scale, headers=MERGE)
        assert status == 200, answer


async def test_the_largest_specs_are_admitted_within_the_runtime_cost_budget(
    local_cluster: Env,
) -> None:
    """An InferenceService at each of the CRD's largest sizes (every list at its maxItems,
    every string at its maxLength) is created: the CEL rules' runtime cost over the largest
    object stays within the server's per-request budget, which the estimate alone cannot
    show."""
    cluster, ns = local_cluster.cluster, local_cluster.ns
    isvcs = f"{cluster.url}/apis/kvfleet.dev/v1alpha1/namespaces/{ns}/inferenceservices"
    async with cluster.session() as s:
        for case, build in CASES.items():
            spec = build()
            spec["gateway"]["insecureNoAuth"] = True
            meta = {"name": f"largest-{case}", "namespace": ns}
            obj = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "InferenceService",
                   "metadata": meta, "spec": spec}  # fmt: skip
            status, body, _ = await call(s, "POST", isvcs, obj)
            assert status == 201, (case, body.get("message"))
