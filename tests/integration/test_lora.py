"""LoRA adapters over real HTTP: the simulator answers SGLang's adapter endpoints with their
fields and errors, lists loaded adapters in /v1/models, runs a request with the adapter its
`model` or `lora_path` names, and runs at most --max-loras-per-batch adapters in a batch."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import pytest

from kvfleet_sim.lora import AdapterRef, LoraConfig
from tests.conftest import engine_config
from tests.support.metrics import scraped

BASE = "llama-3.1-8b"
ADAPTERS = ("sql", "chat", "code")


async def lora_sim(sim_server: Any, per_batch: int = 8, loaded: int | None = None,
                   time_scale: float = 0.05) -> str:  # fmt: skip
    lora = LoraConfig(enabled=True, adapters=(AdapterRef("sql", "/adapters/sql"),),
                      max_loras_per_batch=per_batch, max_loaded_loras=loaded)  # fmt: skip
    engine = engine_config(max_loras_per_batch=per_batch)
    return str(await sim_server(engine=engine, lora=lora, time_scale=time_scale))


async def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(f"{url}{path}", json=body) as r:
        return r.status, await r.json()


async def test_the_adapter_endpoints_answer_as_sglangs(sim_server: Any) -> None:
    url = await lora_sim(sim_server, per_batch=2, loaded=3)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    try:
        models = {m.id: m for m in (await client.models.list()).data}
        assert set(models) == {BASE, "sql"}
        assert models["sql"].model_extra is not None
        assert models["sql"].model_extra["parent"] == BASE
        assert models["sql"].model_extra["root"] == "/adapters/sql"
        done = await client.chat.completions.create(
            model=f"{BASE}:sql", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert done.usage is not None and done.usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError, match="not loaded: nope"):
            await client.chat.completions.create(
                model=f"{BASE}:nope", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
    finally:
        await client.close()
    status, body = await post(url, "/load_lora_adapter",
                              {"lora_name": "chat", "lora_path": "/adapters/chat"})  # fmt: skip
    assert status == 200 and body["success"] is True
    assert body["loaded_adapters"] == {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    status, body = await post(url, "/load_lora_adapter", {"lora_name": "chat", "lora_path": "x"})
    assert status == 400 and "already loaded" in body["error_message"]
    assert (await post(url, "/load_lora_adapter", {"lora_name": "c", "lora_path": "y"}))[0] == 200
    status, body = await post(url, "/load_lora_adapter", {"lora_name": "d", "lora_path": "z"})
    assert (
        status == 400
        and "Maximum number of loaded LoRA adapters reached (3)" in (body["error_message"])
    )
    status, body = await post(url, "/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 200 and "chat" not in body["loaded_adapters"]
    status, body = await post(url, "/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 400 and body["success"] is False
    # /generate names the adapter with lora_path.
    two = {"text": "hi", "lora_path": "sql", "sampling_params": {"max_new_tokens": 2}}
    status, body = await post(url, "/generate", two)
    assert status == 200, body


async def test_a_batch_runs_at_most_max_loras_per_batch_adapters(sim_server: Any) -> None:
    """One adapter per batch: a request for a second adapter waits until the first one's
    requests are done; a request for the same adapter joins at once."""
    url = await lora_sim(sim_server, per_batch=1, time_scale=1.0)
    await post(url, "/load_lora_adapter", {"lora_name": "chat", "lora_path": "/adapters/chat"})

    async def ask(adapter: str, tokens: int) -> tuple[float, float]:
        start = time.monotonic()
        status, _ = await post(url, "/generate", {
            "text": "hello there", "lora_path": adapter,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}})  # fmt: skip
        assert status == 200
        return start, time.monotonic()

    first = asyncio.create_task(ask("sql", 100))  # ~0.7 s of decoding
    await asyncio.sleep(0.05)
    same, other = await asyncio.gather(ask("sql", 5), ask("chat", 5))
    (_, first_end) = await first
    assert same[1] < first_end  # the same adapter shared the batch
    assert other[1] > first_end  # the other waited for a batch without "sql"


async def test_the_gateway_routes_adapters_by_affinity_and_loads_them_on_demand(
    sim_server: Any, gateway_server: Any
) -> None:
    """Two replicas, one holding `sql`: requests for `sql` go there; `chat`, held nowhere, is
    loaded on one replica and its next requests follow it; a replica at its bound of two
    adapters unloads its least recently used one to load a third; an unknown adapter is a
    404; /v1/models lists the adapters beside the base model."""
    import dataclasses

    from kvfleet_gateway.config import AdapterSource, Lora
    from tests.support.gateway import gateway_config

    holder = await lora_sim(sim_server, per_batch=2)
    other = str(await sim_server(engine=engine_config(max_loras_per_batch=2),
                                 lora=LoraConfig(enabled=True, max_loras_per_batch=2),
                                 time_scale=0.05))  # fmt: skip
    sources = tuple(AdapterSource(name=n, path=f"/adapters/{n}") for n in ADAPTERS)
    lora = Lora(adapters=sources, max_adapters_per_replica=2)
    config = dataclasses.replace(gateway_config([holder, other]), lora=lora)
    url = await gateway_server(config)

    async def served(engine: str) -> set[str]:
        async with aiohttp.ClientSession() as s, s.get(f"{engine}/v1/models") as r:
            return {m["id"] for m in (await r.json())["data"] if m.get("parent")}

    async def prompts(engine: str) -> float:
        return await scraped(f"{engine}/metrics", "sglang:prompt_tokens")

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)

    async def ask(model: str) -> None:
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"a question for {model}"}],
            max_tokens=2,
        )  # fmt: skip

    try:
        listed = {
            m.id: (m.model_extra or {}).get("parent") for m in (await client.models.list()).data
        }
        assert listed == {BASE: None, "sql": BASE, "chat": BASE, "code": BASE}
        for _ in range(3):
            await ask("sql")
        assert await prompts(other) == 0  # every sql request went to the replica holding it
        await ask("chat")
        chat_on = holder if "chat" in await served(holder) else other
        assert "chat" in await served(chat_on)
        before = await prompts(chat_on)
        await ask(f"{BASE}:chat")
        assert await prompts(chat_on) > before
        with pytest.raises(openai.NotFoundError):
            await ask("nope")
    finally:
        await client.close()
    assert len(await served(holder)) <= 2 and len(await served(other)) <= 2


async def test_a_replica_at_its_adapter_bound_unloads_the_least_recently_used(
    sim_server: Any, gateway_server: Any
) -> None:
    import dataclasses

    from kvfleet_gateway.config import AdapterSource, Duration, Lora
    from tests.support.gateway import gateway_config

    engine = await lora_sim(sim_server, per_batch=2)  # holds sql
    sources = tuple(AdapterSource(name=n, path=f"/adapters/{n}") for n in ADAPTERS)
    # (chat is unloaded moments after its load: no minimum residency here)
    lora = Lora(adapters=sources, max_adapters_per_replica=2, min_residency=Duration(0))
    config = dataclasses.replace(gateway_config([engine]), lora=lora)
    url = await gateway_server(config)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    try:
        for model in ("chat", "sql", "code"):  # chat loaded; sql used last; code needs room
            await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
    finally:
        await client.close()
    async with aiohttp.ClientSession() as s, s.get(f"{engine}/v1/models") as r:
        held = {m["id"] for m in (await r.json())["data"] if m.get("parent")}
    assert held == {"sql", "code"}  # chat, the least recently used, made room
    # What each replica holds is exported, as its engine reports it (read at each probe).
    from tests.support.gateway import metrics_url

    async def exported() -> set[str]:
        async with aiohttp.ClientSession() as s, s.get(metrics_url(config)) as r:
            text = await r.text()
        return {line.split('adapter="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("kvfleet_gateway_lora_adapter_loaded{")}  # fmt: skip

    from tests.support.waiting import until

    await until(lambda: _equal(exported(), held), 5, "the held adapters exported")


async def _equal(found: Any, expected: set[str]) -> bool:
    return bool(await found == expected)


async def test_a_probe_read_before_a_load_does_not_forget_the_adapter() -> None:
    """A health probe reads the engine's /v1/models; the gateway loads an adapter while that
    reading is on its way. Applied late, the stale list would drop the new adapter and the next
    request for it would load it again elsewhere (seen in CI: two replicas loaded one adapter)."""
    from aiohttp import web

    from kvfleet_gateway.backends import BackendPool
    from kvfleet_gateway.config import AdapterSource, Lora
    from kvfleet_gateway.lora import AdapterManager
    from kvfleet_sim.procs import free_port

    listing, release = asyncio.Event(), asyncio.Event()
    held = ["sql"]

    async def models(request: web.Request) -> web.Response:
        data = [{"id": BASE}] + [{"id": n, "parent": BASE} for n in held]
        listing.set()
        await release.wait()  # the answer is read now, delivered after the load
        return web.json_response({"data": data})

    async def load(request: web.Request) -> web.Response:
        held.append((await request.json())["lora_name"])
        return web.json_response({"success": True, "loaded_adapters": list(held)})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/load_lora_adapter", load)
    runner, port = web.AppRunner(app), free_port()
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        pool = BackendPool([f"http://127.0.0.1:{port}"])
        pool.track_adapters = True
        backend = next(iter(pool.backends.values()))
        manager = AdapterManager(Lora(adapters=(AdapterSource(name="chat", path="/a/chat"),)))
        async with aiohttp.ClientSession() as session:
            probe = asyncio.create_task(pool.probe(session, backend))
            await listing.wait()
            await manager.ensure(session, backend, "chat", BASE)
            release.set()
            await probe
            assert backend.healthy and set(backend.adapters) == {"sql", "chat"}
            await pool.probe(session, backend)  # a later reading is applied
            held.remove("chat")
            await pool.probe(session, backend)
            assert set(backend.adapters) == {"sql"}
    finally:
        await runner.cleanup()
