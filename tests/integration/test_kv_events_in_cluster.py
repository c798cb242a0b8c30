"""`gateway.prefixIndex: events` deployed as users deploy it: the operator renders engines
with `--kv-events-config`, the gateway pods read the model's tokenizer from its PVC and
subscribe to every engine pod over ZeroMQ (pod addresses, the ports the operator declared),
and a prompt asked again is routed to the replica that caches it — in the local cluster,
where every pod is a process with its own address."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import openai
import yaml

from kvfleet_operator.render.common import GATEWAY_METRICS_PORT
from kvfleet_operator.status import pod_ready
from tests.support.cluster import Env
from tests.support.kubectl import kubectl
from tests.support.objects import claim
from tests.support.waiting import until

TOKENIZER = Path(__file__).parents[1] / "data" / "tokenizers" / "tiny-chat"
# Llama-3.1-8B's published architecture, with the test's small tokenizer beside it.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
WORDS = "the of and to in is it you that he was for on are as with his they at be this".split()


def service(ns: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": ns},
        "spec": {
            "model": {
                "name": "tiny-chat",
                "source": {"pvc": {"claimName": "models", "path": "tiny-chat"}},
            },
            "replicas": 2,
            "gateway": {"insecureNoAuth": True, "prefixIndex": "events"},
        },
    }


async def volume_path(kc: Path, claim_name: str) -> Path:
    """The directory of the volume bound to a claim (the local provisioner's `hostPath`)."""

    async def bound() -> str:
        return await kubectl(kc, "get", "pvc", claim_name, "-o", "jsonpath={.spec.volumeName}")

    volume = await until(bound, 30, f"claim {claim_name} bound")
    return Path(await kubectl(kc, "get", "pv", volume, "-o", "jsonpath={.spec.hostPath.path}"))


async def test_the_gateway_routes_on_the_engines_kv_events(operator_cluster: Env) -> None:
    kc, ns = operator_cluster.kubeconfig, operator_cluster.ns
    await kubectl(kc, "apply", "-f", "-", stdin=yaml.safe_dump(claim("models", ns)))
    # The model on the claim, as a real cluster's would hold it: config and tokenizer files.
    model = (await volume_path(kc, "models")) / "tiny-chat"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(CONFIG))
    for f in TOKENIZER.glob("*.json"):
        shutil.copy(f, model / f.name)
    await kubectl(kc, "apply", "-f", "-", stdin=yaml.safe_dump(service(ns)))
    out = await kubectl(kc, "wait", "--for=condition=Ready", "kis/chat", "--timeout=90s")
    assert "condition met" in out

    selector = "app.kubernetes.io/instance=chat,app.kubernetes.io/component=gateway"
    pods = json.loads(await kubectl(kc, "get", "pods", "-l", selector, "-o", "json"))["items"]
    ip = next(p["status"]["podIP"] for p in pods if pod_ready(p))

    async def metric(name: str) -> float:
        url = f"http://{ip}:{GATEWAY_METRICS_PORT}/metrics"
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            text = await r.text()
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)
        )

    async def both_live() -> bool:
        return await metric("kvfleet_gateway_kv_event_streams_live") == 2

    await until(both_live, 30, "the gateway subscribed to both engines")
    client = openai.AsyncOpenAI(base_url=f"http://{ip}:8080/v1", api_key="-", max_retries=0)
    try:
        system = " ".join(WORDS[i % len(WORDS)] for i in range(400))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi."}]
        first = await client.chat.completions.create(
            model="tiny-chat",
            messages=messages,
            max_tokens=2,  # type: ignore[arg-type]
        )
        assert first.usage is not None and first.usage.prompt_tokens > 300

        async def stored() -> bool:
            return await metric("kvfleet_gateway_kv_events_total{backend") > 0

        await until(stored, 10, "the engine's BlockStored events at the gateway")
        again = await client.chat.completions.create(
            model="tiny-chat",
            messages=messages,
            max_tokens=2,  # type: ignore[arg-type]
        )
    finally:
        await client.close()
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    # Routed where the events say the prompt is cached: all but the last, partial page hit.
    cached = again.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= again.usage.prompt_tokens - 16, again.usage
    assert await metric("kvfleet_gateway_kv_index_pages") > 0
