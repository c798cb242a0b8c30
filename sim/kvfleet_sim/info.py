"""SGLang's informational endpoints, as the simulator serves them: health, server and model
info, loads, metrics, cache flush."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfleet_sim import api
from kvfleet_sim.lora_http import adapter_cards
from kvfleet_sim.request import Request
from kvfleet_sim.responses import wait_finished
from kvfleet_sim.scheduler import QueueFullError
from kvfleet_sim.server_state import PUBLISHER, SGLANG_VERSION, SimState, state_of

_state = state_of


# ---- info endpoints ----------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200 if _state(request).loaded else 503)


async def health_generate(request: web.Request) -> web.Response:
    """Like SGLang: a one-token generation must succeed."""
    st = _state(request)
    if not st.loaded:
        return web.Response(status=503)
    req = Request(
        rid=f"health-{time.monotonic_ns()}",
        prompt_ids=[1],
        max_new_tokens=1,
        arrival_time=st.engine.clock.now(),
    )
    try:
        channel = st.runner.submit(req)
        await asyncio.wait_for(wait_finished(req, channel), timeout=20)
    except (QueueFullError, TimeoutError):
        st.runner.abort(req)
        return web.Response(status=503)
    return web.Response(status=200)


def _server_args(st: SimState) -> dict[str, Any]:
    c, lay = st.config, st.engine.layout
    e = c.engine
    return {
        "model_path": c.model_path,
        "tokenizer_path": c.tokenizer_path or c.model_path,
        "served_model_name": c.served_model_name,
        "host": c.host,
        "port": c.port,
        "tp_size": e.tp_size,
        "dp_size": 1,
        "pp_size": 1,
        "context_length": lay.context_length,
        "mem_fraction_static": lay.mem_fraction_static,
        "max_running_requests": lay.max_running_requests,
        "max_total_tokens": e.max_total_tokens,
        "max_queued_requests": e.max_queued_requests,
        "chunked_prefill_size": lay.chunked_prefill_size,
        "max_prefill_tokens": e.max_prefill_tokens,
        "schedule_policy": e.schedule_policy,
        "schedule_conservativeness": e.schedule_conservativeness,
        "disable_radix_cache": e.disable_radix_cache,
        "page_size": e.page_size,
        "quantization": None if e.quantization == "none" else e.quantization,
        "kv_cache_dtype": e.kv_cache_dtype,
        "dtype": "auto",
        "enable_metrics": True,
        "stream_interval": c.stream_interval,
        "api_key": None,
        "disaggregation_mode": c.disagg.mode,
        "disaggregation_transfer_backend": c.disagg.transfer_backend,
        "disaggregation_bootstrap_port": c.disagg.bootstrap_port,
        "nnodes": c.dist.nnodes,
        "node_rank": c.dist.node_rank,
        "dist_init_addr": c.dist.dist_init_addr,
        "speculative_algorithm": None,
        "kv_events_config": None if c.kv_events is None else json.dumps(c.kv_events.__dict__),
    }


async def server_info(request: web.Request) -> web.Response:
    st = _state(request)
    load = st.engine.load()
    body = {
        **_server_args(st),
        "max_total_num_tokens": st.engine.layout.max_total_num_tokens,
        "max_req_input_len": st.engine.layout.max_req_input_len,
        "status": "ready" if st.loaded else "starting",
        "version": SGLANG_VERSION,
        "kv_events": (
            None
            if st.config.kv_events is None
            else st.config.kv_events.describe(st.config.engine.page_size)
        ),
        "internal_states": [
            {
                "last_gen_throughput": load.gen_throughput,
                "memory_usage": {
                    "kvcache": round(
                        st.engine.layout.max_total_num_tokens
                        * st.engine.layout.kv_bytes_per_token_per_gpu
                        / 2**30,
                        2,
                    )
                },
            }
        ],
        # Not in SGLang: says honestly what answers. Clients ignore unknown fields.
        "kvfleet_simulator": {
            "gpu": st.config.engine.gpu.name,
            "model": st.config.engine.model.name,
            "profile": st.config.profile,
            "time_scale": st.config.time_scale,
        },
    }
    return web.json_response(body)


async def model_info(request: web.Request) -> web.Response:
    c = _state(request).config
    m = c.engine.model
    return web.json_response(
        {
            "model_path": c.model_path,
            "tokenizer_path": c.model_path,
            "served_model_name": c.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": m.architecture.removesuffix("ForCausalLM").lower(),
            "architectures": [m.architecture],
        }
    )


async def models(request: web.Request) -> web.Response:
    st = _state(request)
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": st.config.served_model_name,
                    "object": "model",
                    "created": api.now_s(),
                    "owned_by": "sglang",
                    "root": st.config.served_model_name,
                    "max_model_len": st.engine.layout.context_length,
                },
                *adapter_cards(st),
            ],
        }
    )


async def loads(request: web.Request) -> web.Response:
    load = _state(request).engine.load()
    return web.json_response(
        {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "version": SGLANG_VERSION,
            "loads": [
                {
                    "dp_rank": 0,
                    "num_running_reqs": load.num_running_reqs,
                    "num_waiting_reqs": load.num_waiting_reqs,
                    "num_used_tokens": load.num_used_tokens,
                    "num_total_tokens": load.max_total_num_tokens,
                    "max_total_num_tokens": load.max_total_num_tokens,
                    "max_running_requests": load.max_running_requests,
                    "token_usage": load.token_usage,
                    "gen_throughput": load.gen_throughput,
                    "cache_hit_rate": load.cache_hit_rate,
                    "utilization": load.utilization,
                    "num_retracted_reqs": load.num_retracted_reqs,
                }
            ],
        }
    )


async def get_load(request: web.Request) -> web.Response:
    load = _state(request).engine.load()
    return web.json_response(
        [
            {
                "dp_rank": 0,
                "num_reqs": load.num_running_reqs + load.num_waiting_reqs,
                "num_waiting_reqs": load.num_waiting_reqs,
                "num_tokens": load.num_used_tokens,
            }
        ]
    )


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(_state(request).metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def flush_cache(request: web.Request) -> web.Response:
    if _state(request).engine.scheduler.flush_cache():
        if publisher := request.app.get(PUBLISHER):
            publisher.flush()
        return web.Response(text="Cache flushed.\n")
    return web.Response(
        status=400, text="Cache not flushed: there are running or waiting requests.\n"
    )
