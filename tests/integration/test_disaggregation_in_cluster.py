"""A disaggregated service as users deploy it: `examples/llama-3.1-70b-disaggregated.yaml`
applied with kubectl (in the test's namespace of the shared cluster), the operator rendering
a prefill pool beside the decode engines, every pod a process. Streamed chats through the
gateway are computed on the prefill pool and decoded on the decode pool; a prefill pod
deleted under load loses no request, and a decode pod deleted mid-stream ends its clients'
streams with an error and leaves nothing reserved."""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import openai

from kvfleet_operator.scaling.autoscaler import AutoscalerConfig
from kvfleet_operator.status import pod_ready
from tests.support.cluster import Env, operator_on
from tests.support.examples import apply_example
from tests.support.kubectl import kubectl
from tests.support.metrics import scraped_sync
from tests.support.waiting import until

PODS = "kvfleet.dev/inferenceservice=llama-70b-pd,app.kubernetes.io/component"
EXAMPLE = ("api-keys-secret.yaml", "hf-token-secret.yaml", "llama-3.1-70b-disaggregated.yaml")


async def _pods(kc: Path, component: str) -> list[dict[str, Any]]:
    """The pods of a component in the kubeconfig's namespace, but those being deleted."""
    out = await kubectl(kc, "get", "pods", "-l", f"{PODS}={component}", "-o", "json")
    return [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]


def _engine_metric(pod: dict[str, Any], name: str) -> float:
    return scraped_sync(f"http://{pod['status']['podIP']}:30000/metrics", name)


def _generated(pod: dict[str, Any]) -> float:
    return _engine_metric(pod, "sglang:generation_tokens_total")


def _running(pod: dict[str, Any]) -> float:
    return _engine_metric(pod, "sglang:num_running_reqs")


# Long enough (~10 s of decode on the simulated H100s) that the kill lands mid-stream even when
# kubectl takes seconds to find and delete the busiest pod on a loaded machine: at 600 tokens
# every stream had finished before the kill in a parallel run.
STREAM_TOKENS = 1500


async def _chat(client: openai.AsyncOpenAI, words: int, tokens: int, unique: str = "") -> int:
    """A streamed chat; `unique` starts the prompt, so no other prompt shares its prefix."""
    stream = await client.chat.completions.create(
        model="llama-3.1-70b-pd",
        messages=[{"role": "user", "content": unique + " ".join(["tell me more"] * words)}],
        max_tokens=tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
    assert usage is not None
    return usage.completion_tokens


async def test_a_disaggregated_service_serves_through_both_pools(
    operator_cluster: Env,
) -> None:
    kc, ns = operator_cluster.kubeconfig, operator_cluster.ns
    await apply_example(kc, ns, *EXAMPLE)
    # Two prefill engines, so one can be lost.
    two = {"spec": {"disaggregation": {"prefill": {"replicas": 2}}}}
    await kubectl(kc, "patch", "kis", "llama-70b-pd", "-n", ns, "--type=merge",
                  "-p", json.dumps(two))  # fmt: skip
    await kubectl(kc, "wait", "--for=condition=Ready", "kis/llama-70b-pd", "-n", ns,
                  "--timeout=120s")  # fmt: skip

    async def both_prefills() -> bool:
        return len([p for p in await _pods(kc, "prefill") if pod_ready(p)]) == 2

    await until(both_prefills, 60, "two ready prefill engines")
    gateway = next(p for p in await _pods(kc, "gateway") if pod_ready(p))
    client = openai.AsyncOpenAI(
        base_url=f"http://{gateway['status']['podIP']}:8080/v1", api_key="foo", max_retries=0
    )
    try:
        assert await _chat(client, 50, 8) == 8
        prefills, decodes = await _pods(kc, "prefill"), await _pods(kc, "engine")
        # The prefill pool computed the prompt and its first token; the decode pool the rest.
        assert sum(_generated(p) for p in prefills) == 1
        assert sum(_generated(p) for p in decodes) == 8
        # A prefill pod killed (no grace) while requests keep arriving: none is lost — a
        # request whose prefill half fails before its decode engine answers is retried.
        done: list[int] = []

        async def keep_asking() -> None:
            loop = asyncio.get_running_loop()
            end = loop.time() + 3.0
            while loop.time() < end:
                done.append(await _chat(client, 400, 16))

        callers = [asyncio.create_task(keep_asking()) for _ in range(4)]
        await asyncio.sleep(0.5)
        await kubectl(kc, "delete", "pod", prefills[0]["metadata"]["name"], "-n", ns,
                      "--grace-period=0", "--force")  # fmt: skip
        await asyncio.gather(*callers)
        assert len(done) > 8 and set(done) == {16}, done
        await _a_decode_pod_lost_mid_stream(kc, gateway["status"]["podIP"])
    finally:
        await client.close()


async def _a_decode_pod_lost_mid_stream(kc: Path, gateway_ip: str) -> None:
    """A decode pod killed (no grace) while it streams: its clients' streams end with an
    error (not a hang, not a quiet cut), the other decode engine's finish, and the budgeted
    tenant's reservations are all settled — none is left reserved."""
    budgeted = openai.AsyncOpenAI(base_url=f"http://{gateway_ip}:8080/v1", api_key="bar",
                                  max_retries=0)  # fmt: skip
    outcomes: list[int | str] = []

    async def long_stream(i: int) -> None:
        try:
            outcomes.append(await _chat(budgeted, 20, STREAM_TOKENS, unique=f"stream {i}:"))
        except openai.APIError as exc:
            outcomes.append(type(exc).__name__)

    try:
        streams = [asyncio.create_task(long_stream(i)) for i in range(4)]
        await asyncio.sleep(1.0)  # every stream under way
        busiest = max(await _pods(kc, "engine"), key=_running)
        assert _running(busiest) > 0
        await kubectl(kc, "delete", "pod", busiest["metadata"]["name"],
                      "--grace-period=0", "--force")  # fmt: skip
        await asyncio.wait_for(asyncio.gather(*streams), 60)
    finally:
        await budgeted.close()
    assert STREAM_TOKENS in outcomes and any(isinstance(o, str) for o in outcomes), outcomes

    def reserved() -> float:
        url = f"http://{gateway_ip}:9090/metrics"
        with urllib.request.urlopen(url) as r:
            text = r.read().decode()
        series = 'kvfleet_gateway_budget_reserved_tokens{tenant="chat-app"'
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(series))  # fmt: skip

    await until(lambda: reserved() == 0, 15, "the budget's reservations settled")


async def test_the_prefill_pool_scales_on_its_own(process_cluster: Env) -> None:
    """Prefill autoscaled (one warm spare), decode fixed at two: a flood of long prompts
    queues at the prefill engine, the autoscaler (reading the engines' /metrics each second)
    promotes the prefill spare and starts another; the decode pool stays as it was."""
    autoscaler = AutoscalerConfig(interval_s=1.0, stale_s=5.0)
    kc, ns = process_cluster.kubeconfig, process_cluster.ns
    async with operator_on(process_cluster, autoscaler):
        await apply_example(kc, ns, *EXAMPLE)
        scaled = {"replicas": None, "autoscaling": {
            "minReplicas": 1, "maxReplicas": 3, "warmReplicas": 1, "targetQueueDepth": 1,
            "scaleUpStabilizationSeconds": 0, "coldStartSeconds": 5}}  # fmt: skip
        patch = {"spec": {"disaggregation": {"prefill": scaled}}}
        await kubectl(kc, "patch", "kis", "llama-70b-pd", "-n", ns, "--type=merge",
                      "-p", json.dumps(patch))  # fmt: skip

        async def roles(component: str) -> list[str]:
            return sorted(
                str((p["metadata"].get("labels") or {}).get("kvfleet.dev/role"))
                for p in await _pods(kc, component)
                if pod_ready(p)
            )

        async def spare() -> bool:
            return await roles("prefill") == ["active", "warm"]

        await until(spare, 60, "one active prefill engine and a warm spare")
        await kubectl(kc, "wait", "--for=condition=Ready", "kis/llama-70b-pd", "-n", ns,
                      "--timeout=60s")  # fmt: skip
        gateway = next(p for p in await _pods(kc, "gateway") if pod_ready(p))
        client = openai.AsyncOpenAI(
            base_url=f"http://{gateway['status']['podIP']}:8080/v1", api_key="foo", max_retries=0
        )
        try:
            flood = [
                asyncio.create_task(_chat(client, 2500, 4, f"{i} {uuid.uuid4().hex} "))
                for i in range(48)
            ]

            async def promoted() -> bool:
                return (await roles("prefill")).count("active") >= 2

            await until(promoted, 45, "the prefill spare promoted under the flood")
            assert set(await asyncio.gather(*flood)) == {4}
            events = await kubectl(kc, "get", "events", "-n", ns, "--field-selector",
                                   "reason=PrefillScaledUp", "-o", "json")  # fmt: skip
            # (A 1 -> 2 may come first: the switch to autoscaling adds the spare.)
            messages = [e["message"] for e in json.loads(events)["items"]]
            assert any(m.startswith("prefill pool 2 -> 3") for m in messages), messages
        finally:
            await client.close()
        assert await roles("engine") == ["active", "active"]  # decode: fixed, untouched
