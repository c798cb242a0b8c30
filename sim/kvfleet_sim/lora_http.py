"""The simulated server's LoRA endpoints and a request's adapter, with SGLang's field names
and answers (see lora.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from kvfleet_sim import api
from kvfleet_sim.lora import AdapterRef, load_seconds
from kvfleet_sim.server_state import SimState, state_of


def adapter_of(st: SimState, model: str | None, lora_path: str | None) -> str | None:
    """The adapter a request names — `model: "<served>:<adapter>"` first, then `lora_path`
    — checked against what is loaded (a 400 otherwise, as SGLang answers)."""
    name = None
    served = st.config.served_model_name
    if model and model != served and ":" in model:
        # The served name may hold colons itself (a URI): match it whole first.
        adapter = (
            model[len(served) + 1 :] if model.startswith(f"{served}:") else model.partition(":")[2]
        )
        name = adapter.strip() or None
    name = name or lora_path
    if name is None:
        return None
    if not st.config.lora.enabled:
        raise api.ApiError("LoRA is not enabled on this server: start it with --enable-lora")
    if name not in st.adapters.loaded:
        loaded = ", ".join(sorted(st.adapters.loaded)) or "none"
        raise api.ApiError(
            f"The following requested LoRA adapters are not loaded: {name}. Loaded adapters:"
            f" {loaded}.",
            param="model",
        )
    return name


def _answer(st: SimState, error: str | None) -> web.Response:
    body = {"success": error is None, "error_message": error,
            "loaded_adapters": st.adapters.summary()}  # fmt: skip
    return web.json_response(body, status=200 if error is None else 400)


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the request body must be a JSON object")
    return body


async def load_lora_adapter(request: web.Request) -> web.Response:
    """`{lora_name, lora_path, pinned}`: reads the adapter (its weights' time from disk)."""
    st = state_of(request)
    body = await _body(request)
    ref = AdapterRef(str(body.get("lora_name") or ""), str(body.get("lora_path") or ""),
                     bool(body.get("pinned", False)))  # fmt: skip
    error = st.adapters.load(ref)
    if error is None:
        model = st.config.engine.model
        await asyncio.sleep(load_seconds(model, st.config.lora.rank) * st.config.time_scale)
    return _answer(st, error)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    st = state_of(request)
    body = await _body(request)
    return _answer(st, st.adapters.unload(str(body.get("lora_name") or "")))


def adapter_cards(st: SimState) -> list[dict[str, Any]]:
    """`/v1/models` entries of the loaded adapters (their parent: the served model)."""
    served = st.config.served_model_name
    return [
        {"id": a.name, "object": "model", "created": api.now_s(), "owned_by": "sglang",
         "root": a.path, "parent": served, "max_model_len": None}
        for a in st.adapters.loaded.values()
    ]  # fmt: skip
