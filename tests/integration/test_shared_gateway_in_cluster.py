"""One gateway for many models, as users deploy it: `kubectl apply -f examples/shared-gateway/`
(an InferenceGateway and two InferenceServices, two base models and an adapter) on the local
cluster with the real operator. Through one URL and one key the OpenAI SDK reaches each model,
alias and adapter; a tenant refused a model gets a 403 naming it; a cost budget runs out at
the model's price; and a price changed on a service reaches the running gateway without a
restart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from kvfleet_operator.render.common import IG_LABEL
from kvfleet_operator.status import pod_ready
from tests.integration.test_status_reasons import kvfleet
from tests.support.cluster import Env
from tests.support.examples import apply_example
from tests.support.kubectl import kubectl
from tests.support.waiting import until

PRICE = {"prompt": 100.0, "cached": 20.0, "output": 1000.0}  # per 1M tokens: a test's scale
BUDGET = 0.05


async def gateway_pod(kc: Path, ns: str, replacing: str | None = None) -> dict[str, Any]:
    """The one ready pod of the shared gateway (another than `replacing`, once it is gone)."""

    async def ready() -> dict[str, Any] | None:
        out = await kubectl(kc, "get", "pods", "-n", ns, "-l", f"{IG_LABEL}=shared", "-o", "json")
        pods = [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]
        if len(pods) != 1 or not pod_ready(pods[0]) or pods[0]["metadata"]["name"] == replacing:
            return None
        return dict(pods[0])

    pod: dict[str, Any] = await until(ready, 60, "one ready pod of the shared gateway")
    return pod


def url_of(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:8080/v1"


async def ask(client: openai.AsyncOpenAI, model: str, max_tokens: int = 3) -> Any:
    return await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello there"}], max_tokens=max_tokens
    )


async def test_one_gateway_serves_two_models_and_an_adapter(
    operator_cluster: Env,
) -> None:
    kc, ns = operator_cluster.kubeconfig, operator_cluster.ns
    await apply_example(kc, ns, "shared-gateway/00-keys.yaml", "hf-token-secret.yaml")
    await apply_example(kc, ns, "shared-gateway")
    for obj in ("kis/chat-8b", "kis/qwen-32b", "kig/shared"):
        await kubectl(kc, "wait", "--for=condition=Ready", obj, "-n", ns, "--timeout=120s")
    status = json.loads(await kubectl(kc, "get", "kig/shared", "-n", ns, "-o", "json"))["status"]
    assert status["services"] == ["chat-8b", "qwen-32b"]
    assert status["models"] == ["fact-gen", "llama", "llama-3.1-8b", "qwen3-32b"]
    pod = await gateway_pod(kc, ns)
    url = url_of(pod)
    # A request that hangs fails the test in a minute, naming itself, not at the test's limit.
    research = openai.AsyncOpenAI(base_url=url, api_key="foo", max_retries=0, timeout=60)
    support = openai.AsyncOpenAI(base_url=url, api_key="bar", max_retries=0, timeout=60)
    try:
        listed = {m.id for m in (await research.models.list()).data}
        assert listed == {"llama-3.1-8b", "llama", "fact-gen", "qwen3-32b"}
        for model in ("llama-3.1-8b", "llama", "fact-gen", "qwen3-32b"):
            reply = await ask(research, model)
            assert reply.usage is not None and reply.usage.completion_tokens == 3, model
        assert {m.id for m in (await support.models.list()).data} == {
            "llama-3.1-8b",
            "llama",
            "fact-gen",
        }
        with pytest.raises(openai.PermissionDeniedError, match="'qwen3-32b' is not available"):
            await ask(support, "qwen3-32b")
        await _a_cost_budget_runs_out_at_the_models_price(
            operator_cluster, support, pod["metadata"]["name"]
        )
    finally:
        await research.close()
        await support.close()


async def _a_cost_budget_runs_out_at_the_models_price(
    cluster: Env, support: openai.AsyncOpenAI, old_pod: str
) -> None:
    """A small budget for the bot (a new gateway config: the pods roll), then a higher price
    on the 8B model (its pool only: the running gateway re-reads it), then requests until
    the budget refuses one — having spent no more than it holds, at that price."""
    kc, ns = cluster.kubeconfig, cluster.ns
    tenants = [
        {
            "name": "support-bot",
            "limits": {
                "models": ["llama-3.1-8b", "llama", "fact-gen"],
                "costBudget": {"amount": BUDGET, "period": "1d"},
            },
        }
    ]
    await kubectl(
        kc,
        "patch",
        "kig/shared",
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"tenants": tenants}}),
    )
    client = support.with_options(base_url=url_of(await gateway_pod(kc, ns, replacing=old_pod)))

    seen: list[float] = []

    async def priced() -> bool:
        """At the new price one token of output costs 0.001: what the remaining budget drops
        by from one request to the next (at the old one, about a millionth)."""
        reply = await client.chat.completions.with_raw_response.create(
            model="llama", messages=[{"role": "user", "content": "hello there"}], max_tokens=1
        )
        seen.append(float(reply.headers["x-kvfleet-budget-remaining-cost"]))
        return len(seen) >= 2 and seen[-2] - seen[-1] > 0.0005

    await kubectl(
        kc,
        "patch",
        "kis/chat-8b",
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"model": {"price": PRICE}}}),
    )
    await until(priced, 30, "the new price at the running gateway")
    spent, refused = 0.0, None
    for _ in range(100):
        try:
            reply = await ask(client, "llama", max_tokens=8)
        except openai.RateLimitError as exc:
            refused = exc
            break
        u = reply.usage
        assert u is not None
        cached = (u.prompt_tokens_details.cached_tokens or 0) if u.prompt_tokens_details else 0
        spent += (
            (u.prompt_tokens - cached) * PRICE["prompt"]
            + cached * PRICE["cached"]
            + u.completion_tokens * PRICE["output"]
        ) / 1e6
    assert refused is not None and "cost budget" in str(refused), refused
    assert 0.02 < spent <= BUDGET
    # What the admin sees: the bot's spend per model, its budget across them.
    code, out, err = await kvfleet(
        cluster, "usage", "shared", "--gateway", "--by-model", "--tenant", "support-bot"
    )
    assert code == 0, err
    rows = {line.split()[2]: line.split() for line in out.splitlines()[1:]}
    assert set(rows) == {"llama-3.1-8b"}  # the adapter and the alias bill their base model
    assert "(cost)" in out and float(rows["llama-3.1-8b"][-2]) >= spent
