"""Request parsing and response shapes of SGLang's native and OpenAI-compatible APIs.

Parsing is pure: a JSON body in, a validated `GenRequest` out, or an `ApiError` that the
server renders in the shape the endpoint uses (`{"error": {...}}` for `/generate`, OpenAI's
`{"object": "error", ...}` for `/v1/*`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["generate", "completion", "chat"]

GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and SGLang's) /v1/completions default


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


@dataclass(frozen=True)
class GenRequest:
    kind: Kind
    rid: str
    stream: bool
    text: str | None
    input_ids: list[int] | None
    max_new_tokens: int | None
    """None: no limit from the client (chat): generate until EOS or the context is full."""
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    include_usage: bool = False
    continuous_usage: bool = False
    """`stream_options.continuous_usage_stats`: usage in every chunk."""
    model: str | None = None
    cache_salt: str | None = None
    """SGLang's cache namespace: a prompt only reuses prefixes cached under the same salt."""
    lora_path: str | None = None
    """The LoRA adapter by name (`model: "<served>:<adapter>"` says it too)."""
    extra: dict[str, Any] = field(default_factory=dict)


def _typed(body: dict[str, Any], key: str, types: type | tuple[type, ...], what: str) -> Any:
    value = body.get(key)
    if value is None:
        return None
    # bool is an int subclass; a JSON `true` is never a valid count.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ApiError(f"'{key}' must be {what}", param=key)
    if not isinstance(value, types):
        raise ApiError(f"'{key}' must be {what}", param=key)
    return value


def _stop(value: Any, key: str = "stop") -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise ApiError(f"'{key}' must be a string or a list of strings", param=key)


def _max_tokens(value: Any, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"'{key}' must be an integer", param=key)
    if value < 0:
        raise ApiError(f"'{key}' must be non-negative, got {value}", param=key)
    return value


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError("'seed' must be an integer", param="seed")
    return value


def _ids(value: Any, key: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    ):
        raise ApiError(f"'{key}' must be a list of non-negative token ids", param=key)
    return value


def parse_generate(body: Any) -> GenRequest:
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError("Either text or input_ids should be provided.")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise ApiError("batched requests are not supported by the simulator; send one per call")
    if text is not None and not isinstance(text, str):
        raise ApiError("'text' must be a string", param="text")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise ApiError("'sampling_params' must be an object", param="sampling_params")
    max_new = _max_tokens(sp.get("max_new_tokens"), "max_new_tokens")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise ApiError("'rid' must be a string", param="rid")
    return GenRequest(
        kind="generate",
        rid=rid or uuid.uuid4().hex,
        stream=bool(_typed(body, "stream", bool, "a boolean")),
        text=text,
        input_ids=_ids(ids, "input_ids") if ids is not None else None,
        max_new_tokens=GENERATE_DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new,
        stop=_stop(sp.get("stop")),
        ignore_eos=bool(sp.get("ignore_eos", False)),
        seed=_seed(sp.get("seed")),
        cache_salt=_salt(body),
        lora_path=_typed(body, "lora_path", str, "an adapter's name"),
    )


def _salt(body: dict[str, Any]) -> str | None:
    salt = _typed(body, "cache_salt", str, "a string")
    return salt or None  # SGLang treats "" as no salt


def _openai_common(body: dict[str, Any]) -> dict[str, Any]:
    n = body.get("n", 1)
    if n != 1:
        raise ApiError("only n=1 is supported", param="n")
    stream = bool(_typed(body, "stream", bool, "a boolean"))
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError("'stream_options' must be an object", param="stream_options")
    if opts and not stream:
        raise ApiError("stream_options can only be set when stream is true", param="stream_options")
    model = _typed(body, "model", str, "a string")
    return {
        "stream": stream,
        "include_usage": bool(opts.get("include_usage", False)),
        "continuous_usage": bool(opts.get("continuous_usage_stats", False)),
        "stop": _stop(body.get("stop")),
        "ignore_eos": bool(body.get("ignore_eos", False)),
        "seed": _seed(body.get("seed")),
        "cache_salt": _salt(body),
        "lora_path": _typed(body, "lora_path", str, "an adapter's name"),
        "model": model,
        "rid": f"{uuid.uuid4().hex}",
    }


def parse_completion(body: Any) -> GenRequest:
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    prompt = body.get("prompt")
    common = _openai_common(body)
    text: str | None = None
    ids: list[int] | None = None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        text = prompt[0]
    elif isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
        ids = _ids(prompt, "prompt")
    elif prompt is None:
        raise ApiError("'prompt' is required", param="prompt")
    else:
        raise ApiError("'prompt' must be a string, or a list of token ids", param="prompt")
    max_tokens = _max_tokens(body.get("max_tokens"), "max_tokens")
    return GenRequest(
        kind="completion",
        text=text,
        input_ids=ids,
        max_new_tokens=COMPLETION_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        **common,
    )


def render_chat(messages: Any) -> str:
    """Llama-3-style chat template: prefix-stable as a conversation grows."""
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    parts = ["<|begin_of_text|>"]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            )
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be a string", param="messages")
        parts.append(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{content}<|eot_id|>")
    parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


def parse_chat(body: Any) -> GenRequest:
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    common = _openai_common(body)
    text = render_chat(body.get("messages"))
    max_tokens = _max_tokens(body.get("max_completion_tokens"), "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _max_tokens(body.get("max_tokens"), "max_tokens")
    return GenRequest(kind="chat", text=text, input_ids=None, max_new_tokens=max_tokens, **common)


# ---- response shapes ---------------------------------------------------------------------


def finish_reason_native(reason: str | None, matched: str | int | None, length: int) -> Any:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": length}
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": "aborted", "status_code": 499}


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def openai_error(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kinds = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        503: "ServiceUnavailableError",
    }
    return {
        "object": "error",
        "message": message,
        "type": kinds.get(status, "InternalServerError"),
        "param": param,
        "code": status,
    }


def now_s() -> int:
    return int(time.time())
