"""The simulator over real HTTP: every SGLang endpoint, shape, error and fault."""

import asyncio
import itertools
import json
from typing import Any

import aiohttp
import pytest

from kvfleet_sim.faults import FaultPlan
from tests.support.waiting import until


async def get(url: str, **kw: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url, **kw) as r:
        body = await r.read()
        try:
            return r.status, json.loads(body)
        except ValueError:
            return r.status, body.decode()


async def post(url: str, payload: Any, **kw: Any) -> tuple[int, Any]:
    data = payload if isinstance(payload, (bytes, str)) else json.dumps(payload)
    async with aiohttp.ClientSession() as s, s.post(url, data=data, **kw) as r:
        body = await r.read()
        try:
            return r.status, json.loads(body)
        except ValueError:
            return r.status, body.decode()


async def sse(url: str, payload: Any) -> list[Any]:
    """Collect SSE events exactly as separated on the wire (blank-line framing)."""
    async with aiohttp.ClientSession() as s, s.post(url, json=payload) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


async def test_info_endpoints_and_aliases(sim_server: Any) -> None:
    url = await sim_server()
    assert (await get(f"{url}/health"))[0] == 200
    assert (await get(f"{url}/ready"))[0] == 200
    for path in ("/server_info", "/get_server_info"):
        status, info = await get(url + path)
        assert status == 200
        assert info["status"] == "ready"
        assert info["tp_size"] == 1
        assert info["chunked_prefill_size"] == 8192
        assert info["max_total_num_tokens"] > 400_000
        assert info["max_req_input_len"] > 0
    for path in ("/model_info", "/get_model_info"):
        _, m = await get(url + path)
        assert m["is_generation"] is True
        assert m["architectures"] == ["LlamaForCausalLM"]
        assert m["model_path"] == "meta-llama/Llama-3.1-8B-Instruct"
    _, models = await get(f"{url}/v1/models")
    assert models["data"][0]["owned_by"] == "sglang"
    assert models["data"][0]["max_model_len"] == 131072
    _, loads = await get(f"{url}/v1/loads")
    entry = loads["loads"][0]
    for key in (
        "dp_rank",
        "num_running_reqs",
        "num_waiting_reqs",
        "num_used_tokens",
        "num_total_tokens",
        "max_total_num_tokens",
        "token_usage",
        "gen_throughput",
        "cache_hit_rate",
        "utilization",
    ):
        assert key in entry
    _, legacy = await get(f"{url}/get_load")
    assert legacy == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert (await get(f"{url}/health_generate"))[0] == 200


async def test_generate_streams_cumulative_text_then_done(sim_server: Any) -> None:
    url = await sim_server()
    events = await sse(
        f"{url}/generate",
        {
            "text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 6},
            "stream": True,
        },
    )
    texts = [e["text"] for e in events]
    assert len(events) == 6
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    last = events[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": 6}
    assert last["completion_tokens"] == 6
    assert last["prompt_tokens"] > 0
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert last["e2e_latency"] > 0
    # Non-streaming returns the same deterministic text.
    _, body = await post(
        f"{url}/generate",
        {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6}},
    )
    assert body["text"] == texts[-1]
    assert body["meta_info"]["cached_tokens"] > 0  # the prompt is in the radix cache now


async def test_stream_interval_batches_tokens(sim_server: Any) -> None:
    url = await sim_server(stream_interval=4)
    events = await sse(
        f"{url}/generate",
        {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 10}},
    )
    assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 5, 9, 10]


async def test_chat_and_completions_shapes(sim_server: Any) -> None:
    url = await sim_server()
    _, chat = await post(
        f"{url}/v1/chat/completions",
        {"model": "llama-3.1-8b", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["choices"][0]["finish_reason"] == "length"
    assert chat["usage"]["completion_tokens"] == 5
    assert chat["usage"]["total_tokens"] == chat["usage"]["prompt_tokens"] + 5
    _, comp = await post(f"{url}/v1/completions", {"prompt": "Once upon", "max_tokens": 3})
    assert comp["object"] == "text_completion"
    assert comp["usage"]["completion_tokens"] == 3
    events = await sse(
        f"{url}/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 4
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == chat["choices"][0]["message"]["content"][: len(text)]


async def test_natural_eos_and_stop_strings(sim_server: Any) -> None:
    url = await sim_server()
    # Without a limit from the client, chat ends at a natural EOS, reported as the stop token.
    _, chat = await post(
        f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "tell me a story"}]}
    )
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert chat["choices"][0]["matched_stop"] == 128009
    # ignore_eos runs to max_tokens.
    _, full = await post(
        f"{url}/v1/completions", {"prompt": "x", "max_tokens": 300, "ignore_eos": True, "seed": 7}
    )
    assert full["usage"]["completion_tokens"] == 300
    word = full["choices"][0]["text"].split()[5]
    _, stopped = await post(
        f"{url}/v1/completions",
        {"prompt": "x", "max_tokens": 300, "ignore_eos": True, "seed": 7, "stop": [word]},
    )
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["matched_stop"] == word
    assert word not in choice["text"]
    assert full["choices"][0]["text"].startswith(choice["text"])


@pytest.mark.parametrize(
    ("model", "model_path", "eos"),
    [("mistral-7b", "mistralai/Mistral-7B-Instruct-v0.3", 2),
     ("qwen3-32b", "Qwen/Qwen3-32B", 151645),
     ("deepseek-v3", "deepseek-ai/DeepSeek-V3", 1)],
)  # fmt: skip
async def test_a_natural_stop_reports_the_models_own_eos_token(
    sim_server: Any, model: str, model_path: str, eos: int
) -> None:
    """Mistral returned Llama-3's <|eot_id|> (128009): the stop token comes from the model's
    config.json (`eos_token_id`) or catalogue entry."""
    from tests.conftest import engine_config

    gpu = "h200" if model == "deepseek-v3" else "h100"
    tp: dict[str, Any] = {"tp_size": 8, "quantization": "fp8"} if model == "deepseek-v3" else {}
    url = await sim_server(engine_config(model, gpu, **tp), served_model_name=model,
                           model_path=model_path)  # fmt: skip
    payload = {"messages": [{"role": "user", "content": "tell me a story"}]}
    _, chat = await post(f"{url}/v1/chat/completions", payload)
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert chat["choices"][0]["matched_stop"] == eos
    _, native = await post(f"{url}/generate", {"text": "tell me a story"})
    assert native["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}


@pytest.mark.parametrize(
    ("path", "payload", "fragment"),
    [
        ("/generate", b"{not json", "Invalid JSON"),
        ("/generate", {"sampling_params": {}}, "Either text or input_ids"),
        ("/generate", {"text": 5}, "'text' must be a string"),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": -1}}, "non-negative"),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": "9"}}, "integer"),
        ("/generate", {"input_ids": list(range(131_072))}, "longer than the model's context"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 200_000}, "maximum context length"),
        ("/v1/completions", {"prompt": "a", "n": 2}, "n=1"),
        ("/v1/completions", {}, "'prompt' is required"),
        ("/v1/chat/completions", {"messages": []}, "non-empty list"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "'role'"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "stream_options": {"include_usage": True},
            },
            "stream is true",
        ),
    ],
)
async def test_bad_input_gets_400_and_server_stays_up(
    sim_server: Any, path: str, payload: Any, fragment: str
) -> None:
    url = await sim_server()
    status, body = await post(url + path, payload)
    assert status == 400
    message = body["error"]["message"] if path == "/generate" else body["message"]
    assert fragment in message
    if path != "/generate":
        assert body["object"] == "error"
        assert body["code"] == 400
    assert (await get(f"{url}/health"))[0] == 200


async def test_api_key_like_sglang(sim_server: Any) -> None:
    url = await sim_server(api_key="s3cret")
    assert (await get(f"{url}/health"))[0] == 200
    assert (await get(f"{url}/metrics"))[0] == 200
    assert (await get(f"{url}/v1/models"))[0] == 401
    ok, _ = await get(f"{url}/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok == 200


async def test_startup_delay_answers_503_until_loaded(sim_server: Any) -> None:
    # The delay runs from the server's start: long enough that a loaded machine's first two
    # requests still fall inside it (0.5 s did not, once, beside a benchmark).
    url = await sim_server(startup_delay_s=4.0)
    assert (await get(f"{url}/health"))[0] == 503
    assert (await post(f"{url}/generate", {"text": "a"}))[0] == 503

    async def loaded() -> bool:
        return (await get(f"{url}/health"))[0] == 200

    await until(loaded, 15.0, "the engine loaded after its startup delay")


async def test_fault_knobs(sim_server: Any) -> None:
    url = await sim_server(faults=FaultPlan(fail_nth=2, drop_nth=3, drop_after_chunks=2))
    body = {"text": "a", "sampling_params": {"max_new_tokens": 20}, "stream": True}
    assert (await post(f"{url}/generate", {"text": "a"}))[0] == 200
    assert (await post(f"{url}/generate", {"text": "a"}))[0] == 500
    async with aiohttp.ClientSession() as s, s.post(f"{url}/generate", json=body) as r:
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
    assert (await post(f"{url}/generate", {"text": "a"}))[0] == 200  # still serving


async def test_flush_cache_and_client_disconnect_aborts(sim_server: Any) -> None:
    url = await sim_server(time_scale=5.0)  # slow enough to disconnect mid-stream
    body = {"text": "a b c", "sampling_params": {"max_new_tokens": 2000}, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/generate", json=body) as r:
        await r.content.readline()  # first event arrived; now hang up
    for _ in range(100):
        _, loads = await get(f"{url}/v1/loads")
        if loads["loads"][0]["num_running_reqs"] == 0:
            break
        await asyncio.sleep(0.05)
    assert loads["loads"][0]["num_running_reqs"] == 0
    assert loads["loads"][0]["num_used_tokens"] == 0
    status, text = await post(f"{url}/flush_cache", b"")
    assert status == 200
    assert "Cache flushed" in text
    _, metrics = await get(f"{url}/metrics")
    assert 'sglang:num_aborted_requests_total{engine_type="unified"' in metrics


async def test_metrics_names_labels_and_buckets(sim_server: Any) -> None:
    url = await sim_server()
    await post(f"{url}/generate", {"text": "hello world", "sampling_params": {"max_new_tokens": 4}})
    _, text = await get(f"{url}/metrics")
    labels = 'engine_type="unified",model_name="llama-3.1-8b",pp_rank="0",tp_rank="0"'
    for name in (
        "num_running_reqs",
        "num_queue_reqs",
        "token_usage",
        "num_used_tokens",
        "cache_hit_rate",
        "gen_throughput",
        "max_total_num_tokens",
        "utilization",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_requests_total",
        "cached_tokens_total",
    ):
        assert f"sglang:{name}{{{labels}}}" in text, name
    assert "# TYPE sglang:time_to_first_token_seconds histogram" in text
    bucket = (
        'sglang:time_to_first_token_seconds_bucket{engine_type="unified",le="400.0",'
        'model_name="llama-3.1-8b",pp_rank="0",tp_rank="0"} 1.0'
    )
    assert bucket in text
    assert f"sglang:generation_tokens_total{{{labels}}} 4.0" in text
    assert "# TYPE sglang:e2e_request_latency_seconds histogram" in text
