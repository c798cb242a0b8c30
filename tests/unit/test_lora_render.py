"""spec.lora rendered: SGLang's LoRA flags on every engine (preloaded adapters in
--lora-paths), adapter claims mounted read-only, and the gateway told which adapters it may
load on demand and from where."""

from __future__ import annotations

from typing import Any

from kvfleet_operator.render import owner_of, render_children
from kvfleet_operator.render.gateway import gateway_config
from tests.support.objects import isvc

LORA = {
    "adapters": [
        {"name": "sql", "source": {"huggingFace": "acme/sql-lora"}, "preload": True},
        {"name": "chat", "source": {"pvc": {"claimName": "adapters", "path": "chat/v2"}}},
        {"name": "code", "source": {"uri": "s3://acme/adapters/code"}},
    ],
    "maxLorasPerBatch": 4,
    "maxLoadedLoras": 6,
    "maxLoraRank": 64,
    "targetModules": ["q_proj", "v_proj"],
}


def _owner(**spec: Any) -> Any:
    doc = isvc("llama", engine={"gpuType": "h100"}, gateway={"insecureNoAuth": True}, **spec)
    doc["metadata"]["uid"] = "5f0c2b9e-0000-4000-8000-00000000000a"
    return owner_of(doc)


def test_sglangs_lora_flags_and_the_adapter_claims() -> None:
    objs = {(o["kind"], o["metadata"]["name"]): o for o in render_children(_owner(lora=LORA))}
    pod = objs[("Deployment", "llama-engine")]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    at = args.index("--enable-lora")
    assert args[at : at + 13] == [
        "--enable-lora", "--max-loras-per-batch", "4", "--max-lora-rank", "64",
        "--max-loaded-loras", "6", "--lora-target-modules", "q_proj", "v_proj",
        "--lora-paths", "sql=acme/sql-lora", "--api-key",
    ]  # fmt: skip
    claims = {v["persistentVolumeClaim"]["claimName"]: v["name"]
              for v in pod["volumes"] if "persistentVolumeClaim" in v}  # fmt: skip
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts[claims["adapters"]]["mountPath"] == "/lora/adapters"
    assert mounts[claims["adapters"]]["readOnly"] is True


def test_the_gateway_learns_every_adapter_and_the_engines_bound() -> None:
    lora = gateway_config(_owner(lora=LORA)).lora
    assert {(a.name, a.path, a.base) for a in lora.adapters} == {
        ("sql", "acme/sql-lora", "llama-3.1-8b"),
        ("chat", "/lora/adapters/chat/v2", "llama-3.1-8b"),
        ("code", "s3://acme/adapters/code", "llama-3.1-8b"),
    }
    assert lora.max_adapters_per_replica == 6
    assert gateway_config(_owner()).lora.adapters == ()


def test_lora_with_disaggregation_is_refused_until_the_gateway_routes_it() -> None:
    import pytest

    from kvfleet_kernel.schema import ConfigError
    from kvfleet_operator.spec import parse_spec

    doc = isvc("llama", lora=LORA, disaggregation={"prefill": {"replicas": 1}})
    with pytest.raises(ConfigError, match="lora with disaggregation is not supported yet"):
        parse_spec(doc["spec"])
