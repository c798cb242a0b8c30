"""The real OpenAI SDK against the simulator: streaming, non-streaming, include_usage."""

from typing import Any

import openai
import pytest


async def test_openai_sdk_non_streaming_and_streaming(sim_server: Any) -> None:
    url = await sim_server()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["llama-3.1-8b"]

        chat = await client.chat.completions.create(
            model="llama-3.1-8b", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8
        )
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage is not None
        assert chat.usage.completion_tokens == 8
        assert chat.choices[0].message.content

        stream = await client.chat.completions.create(
            model="llama-3.1-8b",
            messages=[{"role": "user", "content": "Say hi"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage, finish = [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        assert "".join(pieces) == chat.choices[0].message.content  # deterministic per prompt
        assert finish == "length"
        assert usage is not None
        assert usage.completion_tokens == 8
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens > 0  # second time: prefix cached

        comp = await client.completions.create(model="llama-3.1-8b", prompt="Once", max_tokens=4)
        assert comp.usage is not None
        assert comp.usage.completion_tokens == 4
        n = 0
        async for chunk in await client.completions.create(
            model="llama-3.1-8b", prompt="Once", max_tokens=4, stream=True
        ):
            n += bool(chunk.choices and chunk.choices[0].text)
        assert n == 4
    finally:
        await client.close()


async def test_openai_sdk_sees_bad_request_errors(sim_server: Any) -> None:
    url = await sim_server()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            await client.completions.create(model="m", prompt="x", max_tokens=10**6)
    finally:
        await client.close()
