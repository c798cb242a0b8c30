"""`kvfleet sim serve`: a server indistinguishable from `sglang.launch_server --enable-metrics`.

Endpoints, JSON shapes, SSE framing, metric names and error bodies follow SGLang 0.5.x; what
the server does between receiving a prompt and streaming tokens is the simulated engine
(`engine.py`) running in real time. The app owns its engine loop through a cleanup context.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import zlib
from typing import Any

from aiohttp import web

from kvfleet_sim import api
from kvfleet_sim.datasets import SHAREGPT_LOG_MEDIAN_OUT, SHAREGPT_LOG_SIGMA
from kvfleet_sim.disaggregation import (
    HandOff,
    bootstrap_of,
    bootstrap_server,
    fetch_hand_off,
    transfer_seconds,
)
from kvfleet_sim.engine import Engine, RealClock
from kvfleet_sim.faults import FaultState
from kvfleet_sim.info import (
    flush_cache,
    get_load,
    health,
    health_generate,
    loads,
    metrics,
    model_info,
    models,
    server_info,
)
from kvfleet_sim.kv_events import ZmqKvEventPublisher
from kvfleet_sim.lora import Registry
from kvfleet_sim.lora_http import adapter_of, load_lora_adapter, unload_lora_adapter
from kvfleet_sim.metrics import EngineMetrics
from kvfleet_sim.multinode import Rendezvous
from kvfleet_sim.realtime import Channel, RealtimeRunner
from kvfleet_sim.request import Request
from kvfleet_sim.responses import final_body, stream_response, wait_finished
from kvfleet_sim.scheduler import InputTooLongError, QueueFullError, StepOutcome
from kvfleet_sim.server_state import (
    PUBLISHER,
    SGLANG_VERSION,
    STATE,
    ServerConfig,
    SimState,
    state_of,
)
from kvfleet_sim.tokenizer import HfTokenizer

log = logging.getLogger("kvfleet.sim.server")
_state = state_of
__all__ = ["SGLANG_VERSION", "ServerConfig", "SimState", "exit_now", "make_app"]


# ---- generation --------------------------------------------------------------------------


def _error(kind: api.Kind, err: api.ApiError) -> web.Response:
    if kind == "generate":
        return web.json_response({"error": {"message": err.message}}, status=err.status)
    return web.json_response(
        api.openai_error(err.message, err.status, err.param), status=err.status
    )


def _natural_length(seed: int) -> int:
    """Where this request's EOS falls: ShareGPT-like, fixed by the seed."""
    rng = random.Random(seed ^ 0x5EED)
    return max(1, int(math.exp(rng.gauss(SHAREGPT_LOG_MEDIAN_OUT, SHAREGPT_LOG_SIGMA))))


def build_request(st: SimState, gen: api.GenRequest) -> Request:
    """Tokenise, check limits like SGLang, and decide where generation stops."""
    tok = st.engine.tokenizer
    ids = (
        gen.input_ids
        if gen.input_ids is not None
        # A chat template writes its own begin-of-text; a bare prompt gets the tokenizer's.
        else tok.encode(gen.text or "", add_special_tokens=gen.kind != "chat")
    )
    if not ids:
        raise api.ApiError("The input is empty: send at least one token.")
    ctx = st.engine.layout.context_length
    if len(ids) >= ctx:
        raise api.ApiError(
            f"The input ({len(ids)} tokens) is longer than the model's context length "
            f"({ctx} tokens)."
        )
    max_new = gen.max_new_tokens if gen.max_new_tokens is not None else ctx - len(ids)
    if len(ids) + max_new > ctx:
        raise api.ApiError(
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
            f"You requested a total of {len(ids) + max_new} tokens: {len(ids)} tokens from the "
            f"input messages and {max_new} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit.",
            param="max_tokens",
        )
    seed = gen.seed if gen.seed is not None else zlib.crc32(json.dumps(ids[-64:]).encode())
    req = Request(
        rid=gen.rid,
        prompt_ids=ids,
        max_new_tokens=max_new,
        arrival_time=st.engine.clock.now(),
        seed=seed,
        cache_salt=gen.cache_salt,
        adapter=adapter_of(st, gen.model, gen.lora_path),
    )
    if gen.stop and max_new:
        text = tok.decode(tok.generate_ids(seed, max_new))
        hits = [(text.find(s) + len(s), s) for s in gen.stop if s in text]
        if hits:
            end, matched = min(hits)
            # The first token whose text reaches the end of the match.
            n, acc = 0, 0
            for piece in tok.generate_ids(seed, max_new):
                n += 1
                acc += len(tok.decode([piece]))
                if acc >= end:
                    break
            req.stop_at, req.stop_matched = n, matched
    if st.config.simulate_eos and not gen.ignore_eos:
        eos = _natural_length(seed)
        if eos < max_new and (req.stop_at is None or eos < req.stop_at):
            req.stop_at, req.stop_matched = eos, None
    return req


async def _generate(request: web.Request, kind: api.Kind) -> web.StreamResponse:
    st = _state(request)
    if not st.loaded:
        return _error(kind, api.ApiError("The server is starting (loading the model).", 503))
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(kind, api.ApiError("Invalid JSON in the request body."))
    parser = {
        "generate": api.parse_generate,
        "completion": api.parse_completion,
        "chat": api.parse_chat,
    }[kind]
    try:
        gen = parser(body)
        req = build_request(st, gen)
        await _disaggregated(st, body, req)
    except api.ApiError as err:
        return _error(kind, err)
    nth = st.faults.next_request()
    plan = st.faults.plan
    if plan.fail_nth == nth:
        return _error(kind, api.ApiError("injected fault: request failed", 500))
    if plan.stall_nth == nth:
        await asyncio.sleep(plan.stall_seconds)
    try:
        channel = st.runner.submit(req)
    except QueueFullError:
        return _error(kind, api.ApiError("The request queue is full.", 503))
    except InputTooLongError as exc:
        return _error(kind, api.ApiError(str(exc)))
    try:
        if gen.stream:
            drop = plan.drop_after_chunks if plan.drop_nth == nth else None
            return await stream_response(request, st, gen, req, channel, drop_after=drop)
        if not await _finished_unless_gone(request, req, channel):
            return web.Response(status=499)  # nobody reads it: the request was aborted
        return web.json_response(final_body(st, gen, req))
    finally:
        if not req.finished:
            st.runner.abort(req)


async def _disaggregated(st: SimState, body: Any, req: Request) -> None:
    """PD mode: a prefill server computes the prompt and one token, then offers the KV under
    the request's room; a decode server first waits for that KV to arrive."""
    mode = st.config.disagg.mode
    if mode == "null":
        return
    boot = bootstrap_of(body)
    if boot is None:
        raise api.ApiError(
            f"this server runs --disaggregation-mode {mode}: a request needs bootstrap_host,"
            " bootstrap_port and bootstrap_room (send it through a PD router)"
        )
    if mode == "prefill":
        req.max_new_tokens = min(req.max_new_tokens, 1)
        st.pending_rooms[req.rid] = boot.room
        return
    try:
        hand_off = await fetch_hand_off(boot)
    except ConnectionError as exc:
        raise api.ApiError(f"KV transfer for room {boot.room} failed: {exc}", 500) from exc
    await asyncio.sleep(hand_off.transfer_s * st.config.time_scale)
    req.prefilled, req.cached_tokens = True, hand_off.cached_tokens


def _offer_prefilled(st: SimState, outcome: StepOutcome) -> None:
    """Prefill mode, after each step: requests with their first token offer their KV."""
    layout = st.engine.layout
    for req in outcome.first_tokens:
        room = st.pending_rooms.pop(req.rid, None)
        if room is not None:
            seconds = transfer_seconds(req.prompt_len, layout.kv_bytes_per_token_per_gpu,
                                       st.config.disagg.link)  # fmt: skip
            st.rooms.offer(room, HandOff(req.prompt_len, req.cached_tokens, seconds))
    for req in outcome.finished:  # finished or aborted without a first token
        st.pending_rooms.pop(req.rid, None)


def _forget_room(st: SimState, req: Request) -> None:
    st.pending_rooms.pop(req.rid, None)


DISCONNECT_CHECK_S = 1.0
"""How often a non-streaming request checks that its client is still there (SGLang's
tokenizer manager checks while it waits, and aborts the request of a client that left)."""


async def _finished_unless_gone(request: web.Request, req: Request, channel: Channel) -> bool:
    """Wait for `req` to finish; False as soon as its client has disconnected."""
    waiter = asyncio.ensure_future(wait_finished(req, channel))
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=DISCONNECT_CHECK_S)
            if done:
                return True
            transport = request.transport
            if transport is None or transport.is_closing():
                return False
    finally:
        waiter.cancel()


async def generate(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "generate")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


# ---- app ---------------------------------------------------------------------------------

OPEN_PREFIXES = ("/health", "/ready", "/metrics")
"""Paths SGLang 0.5.23 serves without the key (`utils/auth.py`, by prefix): probes and
scrapers never hold it."""


def _auth_middleware(api_key: str) -> Any:
    import hmac

    expected = api_key.encode()

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "OPTIONS" or request.path.startswith(OPEN_PREFIXES):
            return await handler(request)  # type: ignore[no-any-return]
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), expected):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)  # type: ignore[no-any-return]

    return check


def make_app(config: ServerConfig) -> web.Application:
    clock = RealClock(config.time_scale)
    tokenizer = HfTokenizer.load(config.tokenizer_path) if config.tokenizer_path else None
    engine = Engine(
        config.engine, clock, profile=config.profile, truth=config.truth, tokenizer=tokenizer
    )
    state = SimState(
        config=config,
        engine=engine,
        runner=RealtimeRunner(engine, clock),
        metrics=EngineMetrics(engine, config.served_model_name, config.engine.tp_size),
        faults=FaultState(config.faults),
        adapters=Registry(config.lora),
    )
    middlewares = [_auth_middleware(config.api_key)] if config.api_key else []
    app = web.Application(middlewares=middlewares, client_max_size=64 * 2**20)
    app[STATE] = state

    async def engine_loop(app: web.Application) -> Any:
        async with app[STATE].runner.running():
            yield

    async def kv_event_publisher(app: web.Application) -> Any:
        events = config.kv_events
        if events is None or events.publisher != "zmq" or config.engine.disable_radix_cache:
            yield
            return
        publisher = ZmqKvEventPublisher(events, config.engine.page_size)
        engine.scheduler.cache.events = publisher
        engine.listeners.append(lambda _engine, _step, _outcome: publisher.flush())
        app[PUBLISHER] = publisher
        try:
            yield
        finally:
            publisher.close()

    async def rendezvous(app: web.Application) -> Any:
        if config.dist.nnodes == 1:
            yield
            return
        meeting = app[STATE].rendezvous = Rendezvous(config.dist)
        await meeting.start()
        try:
            yield
        finally:
            await meeting.close()

    async def prefill_bootstrap(app: web.Application) -> Any:
        if config.disagg.mode != "prefill":
            yield
            return
        engine.listeners.append(lambda _engine, _step, outcome: _offer_prefilled(state, outcome))
        engine.aborted_listeners.append(lambda req: _forget_room(state, req))
        async with bootstrap_server(state.rooms, config.host, config.disagg.bootstrap_port):
            yield

    app.cleanup_ctx.extend([rendezvous, prefill_bootstrap, kv_event_publisher, engine_loop])
    r = app.router
    r.add_get("/health", health)
    r.add_get("/ready", health)
    r.add_get("/health_generate", health_generate)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    r.add_get("/v1/loads", loads)
    r.add_get("/get_load", get_load)
    r.add_get("/v1/models", models)
    r.add_get("/metrics", metrics)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/load_lora_adapter", load_lora_adapter)
    r.add_post("/unload_lora_adapter", unload_lora_adapter)
    r.add_post("/generate", generate)
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/chat/completions", chat_completions)
    return app


def exit_now() -> None:
    """The crash fault: no cleanup, no goodbye, like a killed engine."""
    os._exit(1)
