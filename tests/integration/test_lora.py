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

BASE = "llama-3.1-8b"


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
