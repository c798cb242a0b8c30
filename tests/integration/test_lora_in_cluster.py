"""LoRA as users deploy it: `examples/llama-3.1-8b-lora.yaml` applied with kubectl (in the
test's namespace of the shared cluster); every pod a process (the engines simulators with
SGLang's LoRA flags as rendered). Through the gateway and the OpenAI SDK, the preloaded
adapter is served where it is held and the other is loaded on demand on the replica the
gateway picks."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai

from kvfleet_operator.status import pod_ready
from tests.support.cluster import Env
from tests.support.examples import apply_example
from tests.support.kubectl import kubectl

SELECTOR = "app.kubernetes.io/instance=llama-8b-lora,app.kubernetes.io/component"


async def _pods(kc: Path, ns: str, component: str) -> list[dict[str, Any]]:
    out = await kubectl(kc, "get", "pods", "-n", ns, "-l", f"{SELECTOR}={component}", "-o",
                        "json")  # fmt: skip
    return [p for p in json.loads(out)["items"] if pod_ready(p)]


async def _held(pod: dict[str, Any], key: str) -> set[str]:
    url = f"http://{pod['status']['podIP']}:30000/v1/models"
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        return {m["id"] for m in (await r.json())["data"] if m.get("parent")}


async def test_the_lora_example_serves_preloaded_and_on_demand_adapters(
    operator_cluster: Env,
) -> None:
    kc, ns = operator_cluster.kubeconfig, operator_cluster.ns
    await apply_example(kc, ns, "api-keys-secret.yaml", "hf-token-secret.yaml")
    await apply_example(kc, ns, "llama-3.1-8b-lora.yaml")
    await kubectl(kc, "wait", "--for=condition=Ready", "kis/llama-8b-lora", "-n", ns,
                  "--timeout=120s")  # fmt: skip
    # Ready is serving (one replica will do); every replica ready is the rollout done.
    await kubectl(kc, "wait", "--for=condition=Progressing=False", "kis/llama-8b-lora", "-n",
                  ns, "--timeout=120s")  # fmt: skip
    engines = await _pods(kc, ns, "engine")
    gateway = (await _pods(kc, ns, "gateway"))[0]
    secret = json.loads(await kubectl(kc, "get", "secret", "llama-8b-lora-engine-key", "-n",
                                      ns, "-o", "json"))  # fmt: skip
    key = base64.b64decode(next(iter(secret["data"].values()))).decode()
    assert [await _held(p, key) for p in engines] == [{"fact-gen"}] * 2  # --lora-paths
    client = openai.AsyncOpenAI(base_url=f"http://{gateway['status']['podIP']}:8080/v1",
                                api_key="foo", max_retries=0)  # fmt: skip
    try:
        listed = {m.id for m in (await client.models.list()).data}
        assert {"llama-3.1-8b", "fact-gen", "topic-control"} <= listed
        for model in ("fact-gen", "llama-3.1-8b:fact-gen", "topic-control", "topic-control"):
            done = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=3
            )
            assert done.usage is not None and done.usage.completion_tokens == 3
    finally:
        await client.close()
    held = [await _held(p, key) for p in engines]
    # topic-control was loaded on demand on one replica, and its second request found it there.
    assert sorted(len(h) for h in held) == [1, 2] and any("topic-control" in h for h in held)
