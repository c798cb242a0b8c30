"""A disaggregated service renders a prefill pool beside its engines (the decode pool), with
SGLang's PD flags, the gateway's prefill backends, and NetworkPolicies that let the two pools
— and only they, the gateway and scrapers — reach each other."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kvfleet_gateway.config import GatewayConfig
from kvfleet_kernel.schema import ConfigError
from kvfleet_operator.render import owner_of, render_children
from kvfleet_operator.render.gateway import CONFIG_KEY
from kvfleet_operator.spec import parse_spec
from tests.support.objects import example

UID = "5f0c2b9e-0000-4000-8000-000000000004"


def _service(**disaggregation: Any) -> dict[str, Any]:
    (doc,) = [
        d for d in example("llama-3.1-70b-disaggregated.yaml") if d["kind"] == "InferenceService"
    ]
    doc["metadata"]["uid"] = UID
    doc["spec"]["disaggregation"].update(disaggregation)
    return doc


def _objs(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in render_children(owner_of(doc))}


def _container(dep: dict[str, Any]) -> dict[str, Any]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_two_pools_with_sglangs_pd_flags() -> None:
    objs = _objs(_service())
    decode = _container(objs[("Deployment", "llama-70b-pd-engine")])
    prefill_dep = objs[("Deployment", "llama-70b-pd-prefill")]
    prefill = _container(prefill_dep)
    assert _flag(decode["args"], "--disaggregation-mode") == "decode"
    assert _flag(prefill["args"], "--disaggregation-mode") == "prefill"
    for c in (decode, prefill):
        assert _flag(c["args"], "--disaggregation-transfer-backend") == "mooncake"
    assert _flag(prefill["args"], "--disaggregation-bootstrap-port") == "8998"
    assert {"name": "bootstrap", "containerPort": 8998, "protocol": "TCP"} in prefill["ports"]
    assert prefill_dep["spec"]["replicas"] == 1
    labels = prefill_dep["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "prefill"
    assert labels["kvfleet.dev/role"] == "active"  # not autoscaled: serves when ready
    # Nothing RDMA-specific without an IB device.
    assert "add" not in prefill["securityContext"]["capabilities"]


def test_the_gateway_pairs_the_pools() -> None:
    objs = _objs(_service())
    raw = objs[("ConfigMap", "llama-70b-pd-gateway")]["data"][CONFIG_KEY]
    config = GatewayConfig.from_dict(yaml.safe_load(raw))
    prefill = config.backends.prefill
    assert prefill is not None and prefill.bootstrap_port == 8998
    assert prefill.kubernetes is not None
    assert "app.kubernetes.io/component=prefill" in prefill.kubernetes.selector
    assert config.backends.kubernetes is not None
    assert "app.kubernetes.io/component=engine" in config.backends.kubernetes.selector


def test_only_the_pools_reach_each_other() -> None:
    objs = _objs(_service())

    def sources(name: str) -> list[dict[str, Any]]:
        rules = objs[("NetworkPolicy", name)]["spec"]["ingress"]
        return [peer for rule in rules if "ports" not in rule for peer in rule["from"]]

    def component(peer: dict[str, Any]) -> str:
        return str(peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"])

    assert [component(p) for p in sources("llama-70b-pd-engine")] == ["prefill"]
    assert [component(p) for p in sources("llama-70b-pd-prefill")] == ["engine"]
    assert ("PodMonitor", "llama-70b-pd-prefill") in objs


def test_kv_over_rdma_asks_for_the_nic_and_pinned_memory() -> None:
    objs = _objs(_service(ibDevice="mlx5_0", rdmaResource="rdma/rdma_shared_device_a"))
    for name in ("llama-70b-pd-engine", "llama-70b-pd-prefill"):
        c = _container(objs[("Deployment", name)])
        assert _flag(c["args"], "--disaggregation-ib-device") == "mlx5_0"
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"


def test_the_prefill_pool_has_its_own_gpus_and_resources() -> None:
    own = {"requests": {"memory": "400Gi", "cpu": "48"}}
    doc = _service(
        prefill={"replicas": 3, "tensorParallel": 8, "gpuType": "h200", "resources": own}
    )
    doc["spec"]["engine"]["resources"] = {"requests": {"cpu": "12"}}
    objs = _objs(doc)
    dep = objs[("Deployment", "llama-70b-pd-prefill")]
    c = _container(dep)
    assert dep["spec"]["replicas"] == 3 and _flag(c["args"], "--tp-size") == "8"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"] == "400Gi"
    assert c["resources"]["requests"]["cpu"] == "48"
    selector = dep["spec"]["template"]["spec"]["nodeSelector"]
    assert selector["nvidia.com/gpu.product"] == "NVIDIA-H200"
    decode = _container(objs[("Deployment", "llama-70b-pd-engine")])["resources"]
    assert decode["requests"]["cpu"] == "12" and decode["requests"]["memory"] == "128Gi"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"gateway": {"enabled": False}}, "disaggregation needs the gateway"),
        ({"engine": {"radixCache": False}}, "prefix cache"),
        ({"engine": {"extraArgs": ["--disaggregation-mode", "null"]}}, "manages"),
    ],
)
def test_combinations_sglang_or_the_gateway_refuse(change: dict[str, Any], words: str) -> None:
    spec = _service()["spec"]
    for key, value in change.items():
        spec[key] = {**spec.get(key, {}), **value}
    with pytest.raises(ConfigError) as refused:
        parse_spec(spec)
    assert words in str(refused.value)


def test_a_decode_pool_of_two_node_groups() -> None:
    doc = _service()
    doc["spec"]["engine"].update(nodesPerReplica=2, tensorParallel=8)
    objs = _objs(doc)
    lws = objs[("LeaderWorkerSet", "llama-70b-pd-engine")]
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    assert _flag(leader["args"], "--disaggregation-mode") == "decode"
    assert _flag(leader["args"], "--nnodes") == "2"
    prefill = _container(objs[("Deployment", "llama-70b-pd-prefill")])
    assert "--nnodes" not in prefill["args"]  # the prefill pool stays one node per engine
    assert _flag(prefill["args"], "--tp-size") == "4"


def test_the_prefill_pool_has_its_own_extra_flags() -> None:
    doc = _service(prefill={"extraArgs": ["--enable-mixed-chunk"]})
    doc["spec"]["engine"]["extraArgs"] = ["--enable-torch-compile"]
    objs = _objs(doc)
    prefill = _container(objs[("Deployment", "llama-70b-pd-prefill")])["args"]
    decode = _container(objs[("Deployment", "llama-70b-pd-engine")])["args"]
    assert "--enable-mixed-chunk" in prefill and "--enable-torch-compile" not in prefill
    assert "--enable-torch-compile" in decode and "--enable-mixed-chunk" not in decode
    same = _service()  # unset: the engines' flags
    same["spec"]["engine"]["extraArgs"] = ["--enable-torch-compile"]
    inherited = _container(_objs(same)[("Deployment", "llama-70b-pd-prefill")])["args"]
    assert "--enable-torch-compile" in inherited
    with pytest.raises(ConfigError, match="manages"):
        parse_spec(_service(prefill={"extraArgs": ["--disaggregation-mode=decode"]})["spec"])


def test_the_latency_objectives_go_to_the_pool_that_sets_them() -> None:
    """The decode pool may keep an inter-token latency objective; the prefill pool, which
    makes the first token only, may not; an slo names at least one objective."""
    slo = {"minReplicas": 1, "maxReplicas": 4}
    spec = _service()["spec"]
    del spec["replicas"]
    spec["autoscaling"] = {**slo, "slo": {"itlSeconds": 0.05, "attainment": 0.9}}
    spec["disaggregation"]["prefill"] = {"autoscaling": {**slo, "slo": {"ttftSeconds": 2}}}
    parsed = parse_spec(spec)
    assert parsed.autoscaling is not None and parsed.autoscaling.slo is not None
    assert (
        parsed.autoscaling.slo.itl_seconds == 0.05 and parsed.autoscaling.slo.ttft_seconds is None
    )
    spec["disaggregation"]["prefill"]["autoscaling"]["slo"]["itlSeconds"] = 0.05
    with pytest.raises(ConfigError, match="set itlSeconds on the decode pool"):
        parse_spec(spec)
    spec["disaggregation"]["prefill"]["autoscaling"]["slo"] = {"attainment": 0.9}
    with pytest.raises(ConfigError, match="ttftSeconds, itlSeconds or both"):
        parse_spec(spec)
