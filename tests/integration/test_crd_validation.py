"""The local cluster treats the InferenceService CRD as an API server does: defaults filled
in, unknown fields pruned, types and bounds checked, CEL rules enforced — on create, on
patch, and on `/scale` (which cannot set replicas on an autoscaled service)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvfleet_localcluster.emulated import EmulatedCluster
from tests.support.emulated import emulated_cluster_config as cluster_config
from tests.support.objects import isvc as make_isvc

ROOT = Path(__file__).resolve().parents[2]
ISVCS = "/apis/kvfleet.dev/v1alpha1/namespaces/default/inferenceservices"
MERGE = {"Content-Type": "application/merge-patch+json"}


def isvc(name: str, **spec: Any) -> dict[str, Any]:
    return make_isvc(name, namespace="default", **spec)


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


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    async with EmulatedCluster(cluster_config(tmp_path)) as cluster, cluster.session() as s:
        yield cluster.url, s


async def test_defaults_pruning_and_rules(api: tuple[str, aiohttp.ClientSession]) -> None:
    url, s = api
    body = isvc("ok", replicas=2, notAField=1)
    async with s.post(url + ISVCS, json=body) as r:
        assert r.status == 201
        created = await r.json()
    spec = created["spec"]
    assert "notAField" not in spec
    assert spec["engine"]["tensorParallel"] == 1  # defaults from the schema
    # Images are not defaulted at admission: an unset image follows the operator's release,
    # so upgrading the operator moves the data plane (a stored default would freeze it).
    assert "image" not in spec["engine"] and "image" not in spec["gateway"]
    assert spec["gateway"]["routingPolicy"] == "kvfleet"

    cases = [
        (
            isvc("a", replicas=2, autoscaling={"maxReplicas": 3}),
            "replicas and autoscaling are mutually exclusive",
        ),
        (
            isvc("b", engine={"tensorParallel": 3}),
            "spec.engine.tensorParallel: Unsupported value: 3",
        ),
        (isvc("c", engine={"extraArgs": ["--port=1"]}), "spec.engine.extraArgs[0]: Invalid value"),
        (  # an abbreviation SGLang's parser takes for --api-key
            isvc("c2", engine={"extraArgs": ["--api-ke=attacker"]}),
            "spec.engine.extraArgs[0]: Invalid value",
        ),
        (isvc("d", replicas="two"), "spec.replicas in body must be of type integer"),
        # Every child name must fit: '-engine' on a Service name of at most 63 characters.
        (isvc("a" * 57), "metadata.name: Invalid value"),
        (isvc("7b-model"), "metadata.name: Invalid value"),
        (
            isvc("e", autoscaling={"minReplicas": 5, "maxReplicas": 2}),
            "spec.autoscaling.minReplicas",
        ),
        (
            {**isvc("f"), "spec": {"gateway": {"insecureNoAuth": True}}},
            "spec.model: Required value",
        ),
        *HOSTILE,
    ]
    for obj, message in cases:
        async with s.post(url + ISVCS, json=obj) as r:
            assert r.status == 422, obj
            assert message in (await r.json())["message"]

    # Updates are admitted the same way; /scale writes spec.replicas through the rules.
    async with s.patch(
        f"{url}{ISVCS}/ok", json={"spec": {"engine": {"tensorParallel": 5}}}, headers=MERGE
    ) as r:
        assert r.status == 422
    auto = isvc("auto", autoscaling={"minReplicas": 1, "maxReplicas": 4})
    async with s.post(url + ISVCS, json=auto) as r:
        assert r.status == 201
    async with s.patch(
        f"{url}{ISVCS}/auto/scale", json={"spec": {"replicas": 3}}, headers=MERGE
    ) as r:
        assert r.status == 422
        assert "mutually exclusive" in (await r.json())["message"]
    async with s.patch(
        f"{url}{ISVCS}/ok/scale", json={"spec": {"replicas": 3}}, headers=MERGE
    ) as r:
        assert r.status == 200
