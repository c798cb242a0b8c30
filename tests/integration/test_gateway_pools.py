"""One gateway in front of many pools, over real HTTP against simulated engines: requests go to
the pool serving their `model` (names, aliases), `/v1/models` lists what the key may use, a
tenant's allow-list refuses other models with a 403 naming them, a cost budget is spent at
each model's own price, and pools come and go with their file, without a restart."""

import asyncio
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvfleet_gateway.config import GatewayConfig, Price
from kvfleet_gateway.keys import hash_key
from tests.support.gateway import gateway_config, metrics_url
from tests.support.metrics import scraped

SMALL = Price(prompt=100.0, cached=10.0, output=400.0)  # per 1M tokens
LARGE = Price(prompt=900.0, cached=90.0, output=3600.0)  # a 70B model's token costs more
KEYS = {"open": "kvf-open", "narrow": "kvf-narrow", "metered": "kvf-metered"}
BUDGET = 0.25


def keys_file(tmp_path: Path) -> Path:
    limits: dict[str, Any] = {
        "open": {},
        "narrow": {"models": ["small"]},
        "metered": {"costBudget": {"amount": BUDGET, "period": "1d"}},
    }
    tenants = [{"name": n, "keys": [hash_key(k)], "limits": limits[n]} for n, k in KEYS.items()]
    path = tmp_path / "keys.yaml"
    path.write_text(json.dumps({"tenants": tenants}))
    return path


def pool(name: str, model: str, engine: str, price: Price, aliases: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "models": [
            {"name": model, "aliases": aliases, "ownedBy": name, "price": dataclasses.asdict(price)}
        ],
        "backends": {"static": [engine]},
    }


def shared_config(tmp_path: Path, pools: list[dict[str, Any]]) -> tuple[GatewayConfig, Path]:
    pools_file = tmp_path / "pools.yaml"
    pools_file.write_text(yaml.safe_dump({"pools": pools}))
    base = gateway_config(["http://unused:1"], keys_file(tmp_path))
    return dataclasses.replace(base, backends=None, pools_file=str(pools_file)), pools_file


async def call(
    s: aiohttp.ClientSession, gw: str, tenant: str, model: str, max_tokens: int = 8
) -> tuple[int, dict[str, Any], dict[str, str]]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something kind."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    async with s.post(f"{gw}/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, await r.json(), dict(r.headers)


async def served_by(engine: str) -> float:
    return await scraped(f"{engine}/metrics", "sglang:num_requests")


async def two_pools(
    sim_server: Any, gateway_server: Any, tmp_path: Path, aliases: bool = True
) -> tuple[str, str, GatewayConfig, str]:
    """Engines of a small and a large model, one gateway in front of both: (small, large,
    its config, its URL)."""
    small = await sim_server(served_model_name="small")
    large = await sim_server(served_model_name="large")
    pools = [
        pool("ai/small", "small", small, SMALL, ["chat"] if aliases else []),
        pool("ai/large", "large", large, LARGE, ["big"] if aliases else []),
    ]
    cfg, _ = shared_config(tmp_path, pools)
    return small, large, cfg, await gateway_server(cfg)


async def test_requests_go_to_the_pool_serving_their_model(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    small, large, _, gw = await two_pools(sim_server, gateway_server, tmp_path)
    async with aiohttp.ClientSession() as s:
        for model, engine, answered in (
            ("small", small, "small"),
            ("chat", small, "small"),
            ("large", large, "large"),
            ("big", large, "large"),
        ):
            before = await served_by(engine)
            status, body, _ = await call(s, gw, "open", model)
            assert status == 200, body
            assert body["model"] == answered  # an alias reaches the engine by its served name
            assert await served_by(engine) == before + 1
        status, body, _ = await call(s, gw, "open", "tiny")
        assert status == 404 and body["error"]["code"] == "model_not_found"
        async with s.get(
            f"{gw}/v1/models", headers={"Authorization": f"Bearer {KEYS['open']}"}
        ) as r:
            listed = {m["id"]: m for m in (await r.json())["data"]}
        assert set(listed) == {"small", "chat", "large", "big"}
        assert listed["large"]["owned_by"] == "ai/large" and listed["big"]["root"] == "large"
        async with s.get(
            f"{gw}/v1/models", headers={"Authorization": f"Bearer {KEYS['narrow']}"}
        ) as r:
            assert {m["id"] for m in (await r.json())["data"]} == {"small", "chat"}


async def test_a_tenant_may_use_only_the_models_it_is_allowed(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    _, large, _, gw = await two_pools(sim_server, gateway_server, tmp_path)
    async with aiohttp.ClientSession() as s:
        assert (await call(s, gw, "narrow", "small"))[0] == 200
        assert (await call(s, gw, "narrow", "chat"))[0] == 200  # an alias of an allowed model
        before = await served_by(large)
        for name in ("large", "big"):
            status, body, _ = await call(s, gw, "narrow", name)
            assert status == 403, body
            assert body["error"]["code"] == "model_not_allowed"
            assert f"'{name}'" in body["error"]["message"]
        assert await served_by(large) == before  # refused before any engine saw it


async def test_a_cost_budget_is_spent_at_each_models_price(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    _, _, cfg, gw = await two_pools(sim_server, gateway_server, tmp_path, aliases=False)
    prices = {"small": SMALL, "large": LARGE}
    spent = {"small": 0.0, "large": 0.0}
    served = {"small": 0, "large": 0}
    remaining: list[float] = []
    refused = None
    async with aiohttp.ClientSession() as s:
        for i in range(200):
            model = ("small", "large")[i % 2]
            status, body, headers = await call(s, gw, "metered", model, max_tokens=16)
            if status != 200:
                refused = body
                break
            served[model] += 1
            u = body["usage"]
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            spent[model] += prices[model].cost(u["prompt_tokens"], cached, u["completion_tokens"])
            remaining.append(float(headers["x-kvfleet-budget-remaining-cost"]))
    assert refused is not None and refused["error"]["code"] == "insufficient_quota", refused
    message = refused["error"]["message"]
    match = re.search(r"cost budget: this request may cost up to ([0-9.]+)", message)
    assert match is not None, message
    total = spent["small"] + spent["large"]
    # Spent at the priced rate: what was billed fits the budget, and the refused request's
    # bound (its prompt and 16 output tokens at its model's price) would not have.
    assert total <= BUDGET < total + float(match.group(1))
    # The same requests, at nine times the price.
    assert spent["large"] / served["large"] > 5 * spent["small"] / served["small"]
    for model in ("small", "large"):
        billed = await scraped(
            metrics_url(cfg), "kvfleet_gateway_cost", tenant="metered", model=model
        )
        assert abs(billed - spent[model]) < 1e-6, (model, billed, spent[model])
    left = await scraped(
        metrics_url(cfg), "kvfleet_gateway_budget_remaining_cost", tenant="metered"
    )
    assert abs(left - (BUDGET - total)) < 1e-5
    assert min(remaining) >= 0


async def stream(s: aiohttp.ClientSession, gw: str, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Count to ten."}],
            "max_tokens": 8, "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {KEYS['open']}"}
    async with s.post(f"{gw}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def calibrated_models(cfg: GatewayConfig) -> dict[str, set[str]]:
    """The models each calibration gauge has a series for."""
    async with aiohttp.ClientSession() as s, s.get(metrics_url(cfg)) as r:
        text = await r.text()
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("kvfleet_gateway_calibrated_"):
            out[family.name] = {sample.labels["model"] for sample in family.samples}
    return out


async def test_each_pool_reports_its_own_calibration(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """Each pool's policy calibrates on its own model's replicas: its learned prefill rate
    and decode step are series of their own, labelled by model (one unlabelled series
    would show whichever pool answered last)."""
    _, _, cfg, gw = await two_pools(sim_server, gateway_server, tmp_path, aliases=False)
    names = {"kvfleet_gateway_calibrated_prefill_tokens_per_second",
             "kvfleet_gateway_calibrated_decode_step_scale"}  # fmt: skip
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            await stream(s, gw, "small")
        assert await calibrated_models(cfg) == {n: {"small"} for n in names}
        for _ in range(3):
            await stream(s, gw, "large")
    assert await calibrated_models(cfg) == {n: {"small", "large"} for n in names}


async def test_pools_come_and_go_with_their_file(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    small = await sim_server(served_model_name="small")
    large = await sim_server(served_model_name="large")
    cfg, pools_file = shared_config(tmp_path, [pool("ai/small", "small", small, SMALL, [])])
    gw = await gateway_server(cfg)
    state = gateway_server.state(gw)

    async def status_of(model: str) -> int:
        async with aiohttp.ClientSession() as s:
            return (await call(s, gw, "open", model))[0]

    async def until_status(model: str, expected: int) -> None:
        for _ in range(100):
            if await status_of(model) == expected:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{model}: never {expected}")

    assert await status_of("large") == 404
    both = [
        pool("ai/small", "small", small, SMALL, []),
        pool("ai/large", "large", large, LARGE, []),
    ]
    pools_file.write_text(yaml.safe_dump({"pools": both}))
    await until_status("large", 200)
    # A changed pool is replaced while requests flow: the new one serves before the old
    # one stops, so none of them meets a missing model.
    repriced = [both[0], pool("ai/large", "large", large, SMALL, [])]
    reloads = state.pools.reloads
    pools_file.write_text(yaml.safe_dump({"pools": repriced}))
    statuses = []
    while state.pools.reloads == reloads or len(statuses) < 20:
        statuses.append(await status_of("large"))
    assert set(statuses) == {200}
    assert state.pools.pools["ai/large"].price("large") == SMALL
    pools_file.write_text("pools: [{name: broken}]")  # kept out: the pools serve on
    await asyncio.sleep(1.5)
    assert await status_of("large") == 200 and await status_of("small") == 200
    pools_file.write_text(yaml.safe_dump({"pools": repriced[1:]}))
    await until_status("small", 404)
    assert await status_of("large") == 200
    assert state.pools.reloads >= 2
