"""An InferenceGateway rendered from examples/shared-gateway/: one gateway for the services
that name it, their pools in a Secret the gateway re-reads (so a service joining changes no
pod template), and services that name it render no gateway of their own."""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import pytest
import yaml

from kvfleet_gateway.config import ConfigError, GatewayConfig, Price, parse_pools
from kvfleet_operator.render import owner_of, render_children
from kvfleet_operator.render.common import IG_LABEL
from kvfleet_operator.render.shared_gateway import (
    POOLS_KEY,
    Fronted,
    admit,
    gateway_owner_of,
    render_shared_gateway,
)
from tests.support.objects import EXAMPLES

SHARED = EXAMPLES / "shared-gateway"


def docs(kind: str) -> list[dict[str, Any]]:
    found = [
        d
        for f in sorted(SHARED.glob("*.yaml"))
        for d in yaml.safe_load_all(f.read_text())
        if d and d["kind"] == kind
    ]
    for d in found:
        d["metadata"]["uid"] = f"uid-{d['metadata']['name']}"
    return found


def fronted(key: str = "engine-key") -> list[Fronted]:
    return [
        Fronted(owner_of(d), f"{key}-{d['metadata']['name']}") for d in docs("InferenceService")
    ]


def rendered(services: list[Fronted]) -> dict[str, dict[str, Any]]:
    (body,) = docs("InferenceGateway")
    return {
        f"{c['kind']}/{c['metadata']['name']}": c
        for c in render_shared_gateway(gateway_owner_of(body), services)
    }


def pools_of(children: dict[str, dict[str, Any]]) -> tuple[dict[str, str], Any]:
    data = children["Secret/shared-pools"]["data"]
    files = {k: base64.b64decode(v).decode() for k, v in data.items()}
    return files, parse_pools(yaml.safe_load(files[POOLS_KEY]), "pools.yaml")


def test_the_shared_gateway_fronts_every_service_that_names_it() -> None:
    children = rendered(fronted())
    assert {k.split("/")[0] for k in children} >= {
        "Deployment", "Service", "ConfigMap", "Secret", "NetworkPolicy",
        "PodDisruptionBudget", "PodMonitor", "ServiceAccount", "Role", "RoleBinding",
    }  # fmt: skip
    for child in children.values():
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref["kind"] == "InferenceGateway" and ref["name"] == "shared"
        assert child["metadata"]["labels"][IG_LABEL] == "shared"
    assert children["Service/shared"]["spec"]["selector"][IG_LABEL] == "shared"
    config = GatewayConfig.from_dict(
        yaml.safe_load(children["ConfigMap/shared-gateway"]["data"]["gateway.yaml"])
    )
    assert config.backends is None and config.pools_file == "/etc/kvfleet/pools/pools.yaml"
    assert config.auth.keys_file and config.limits_for("support-bot").models == (
        "llama-3.1-8b",
        "llama",
        "fact-gen",
    )
    files, pools = pools_of(children)
    assert [p.name for p in pools] == ["ai/chat-8b", "ai/qwen-32b"]
    llama, qwen = pools
    assert llama.names() == ["llama-3.1-8b", "llama"] and [a.name for a in llama.lora.adapters] == [
        "fact-gen"
    ]
    assert qwen.models[0].price is not None and qwen.models[0].price.output == 2.4
    assert qwen.cost.gpus_per_replica == 2
    for pool in pools:  # each pool's engines' key, beside the pools file
        key_file = pool.backends.engine_api_key_file or ""
        assert files[key_file] == f"engine-key-{pool.name.split('/')[1]}"  # beside pools.yaml
        assert pool.backends.kubernetes is not None
        assert pool.backends.kubernetes.selector.startswith(
            f"kvfleet.dev/inferenceservice={pool.name.split('/')[1]},"
        )


def test_a_service_behind_a_shared_gateway_has_none_of_its_own() -> None:
    for doc in docs("InferenceService"):
        children = render_children(owner_of(doc))
        components = {c["metadata"]["labels"]["app.kubernetes.io/component"] for c in children}
        assert "gateway" not in components
        policy = next(c for c in children if c["kind"] == "NetworkPolicy")
        sources = [p for rule in policy["spec"]["ingress"] for p in rule.get("from", [])]
        assert {
            "podSelector": {
                "matchLabels": {IG_LABEL: "shared", "app.kubernetes.io/component": "gateway"}
            }
        } in sources
        assert owner_of(doc).gateway_url() == "http://shared.ai.svc:8080/v1"


def test_services_joining_or_a_key_rotating_roll_no_gateway_pod() -> None:
    """The pool list changes the Secret the kubelet refreshes, never the pod template; a
    rotated engines' key changes its file's name, so the gateway starts that pool again."""
    both, one = fronted(), fronted()[:1]
    template = [rendered(s)["Deployment/shared-gateway"]["spec"]["template"] for s in (both, one)]
    assert template[0] == template[1]
    assert rendered(both)["Secret/shared-pools"] != rendered(one)["Secret/shared-pools"]
    _, before = pools_of(rendered(both))
    _, after = pools_of(rendered(fronted("rotated")))
    assert [p.backends.engine_api_key_file for p in before] != [
        p.backends.engine_api_key_file for p in after
    ]


def test_two_services_may_not_claim_one_model_name() -> None:
    services = fronted()
    llama = services[0].owner
    model = dataclasses.replace(llama.spec.model, name="qwen3-32b", aliases=())
    twin = dataclasses.replace(
        llama, name="twin", spec=dataclasses.replace(llama.spec, model=model)
    )
    with pytest.raises(
        ConfigError, match="'qwen3-32b' is served by pools 'ai/qwen-32b' and 'ai/twin'"
    ):
        rendered([*services, Fronted(twin, "k")])


def test_admission_leaves_out_only_the_later_claimant_and_an_invalid_pool() -> None:
    """The earlier-created service keeps a name whatever the names' order; a pool the gateway
    would refuse leaves out its service alone; the rest render."""
    services = fronted()
    llama = services[0].owner
    model = dataclasses.replace(llama.spec.model, name="qwen3-32b", aliases=())
    twin = dataclasses.replace(
        llama, name="a-twin", spec=dataclasses.replace(llama.spec, model=model)
    )
    price = dataclasses.replace(llama.spec.model, name="cheap", aliases=(),
                                price=Price(prompt=1.0, cached=-1e6, output=1.0))  # fmt: skip
    credit = dataclasses.replace(
        llama, name="credit", spec=dataclasses.replace(llama.spec, model=price, lora=None)
    )
    dated = [dataclasses.replace(f, created="2026-01-01T00:00:00Z") for f in services]
    later = [
        Fronted(twin, "k", "2026-02-01T00:00:00Z"),
        Fronted(credit, "k", "2026-01-01T00:00:01Z"),
    ]
    (gw,) = docs("InferenceGateway")
    admitted, left_out = admit(gateway_owner_of(gw), [*later, *dated])
    assert sorted(f.owner.name for f in admitted) == ["chat-8b", "qwen-32b"]
    assert (
        "'qwen3-32b' is already served on InferenceGateway shared by InferenceService qwen-32b"
        in (left_out["a-twin"])
    )
    assert "price.cached" in left_out["credit"]
    rendered(admitted)  # the others render


def test_what_a_shared_gateway_cannot_give_the_autoscaler_yet_is_refused() -> None:
    """Scale from zero and an SLO read the service's own gateway (held requests, latency
    histograms); behind a shared gateway the spec says so rather than scaling blind."""
    from kvfleet_kernel.schema import ConfigError as SpecError
    from kvfleet_operator.spec import parse_spec

    (doc, _) = docs("InferenceService")
    spec = {**doc["spec"], "replicas": None}
    for autoscaling, field in (
        ({"minReplicas": 0, "maxReplicas": 3}, "minReplicas"),
        ({"minReplicas": 1, "maxReplicas": 3, "slo": {"ttftSeconds": 1}}, "slo"),
    ):
        with pytest.raises(SpecError, match=f"spec.autoscaling.{field}: .*gateway"):
            parse_spec({**spec, "autoscaling": autoscaling})
    parse_spec({**spec, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}})
