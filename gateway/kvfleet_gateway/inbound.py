"""What a client asked for: validated, with the body to forward and the tokens to reserve.

Validation happens before anything is charged. The forwarded body always asks the engine
for usage (`stream_options.include_usage`) and always carries an explicit token limit, so
the reservation made at admission is an upper bound the engine will respect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from kvfleet_gateway.config import Limits
from kvfleet_gateway.errors import GatewayError, bad_request

Kind = Literal["chat", "completion", "generate"]
FALLBACK_MAX_TOKENS = 1024
"""Injected when neither the client nor the tenant's limits give a max_tokens."""
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's own default for /generate
CHARS_PER_TOKEN_ESTIMATE = 3.0
"""Below the ~4 of English BPE on purpose: reservations should over-, not under-estimate."""
PER_MESSAGE_OVERHEAD = 6  # role header, separators and end-of-turn of a chat template
TEMPLATE_OVERHEAD = 8  # begin-of-text and the assistant header that opens the reply


@dataclass(frozen=True)
class ClientRequest:
    kind: Kind
    model: str
    stream: bool
    client_wants_usage: bool
    max_tokens: int
    prompt_text: str
    estimated_prompt_tokens: int
    body: dict[str, Any]
    """What is sent upstream."""

    @property
    def reserve_tokens(self) -> int:
        return self.estimated_prompt_tokens + self.max_tokens


def estimate_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN_ESTIMATE)


def _int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{key}' must be an integer", key)
    if v < minimum:
        raise bad_request(f"'{key}' must be at least {minimum}, got {v}", key)
    return v


def _chat_prompt(messages: Any) -> tuple[str, int]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    parts: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        if content is not None and not isinstance(content, str):
            raise bad_request(
                f"messages[{i}].content must be a string or a list of parts", "messages"
            )
        parts.append(f"{m['role']}: {content or ''}\n")
    text = "".join(parts)
    content_chars = sum(len(p) - len(m["role"]) - 3 for p, m in zip(parts, messages, strict=True))
    estimate = math.ceil(content_chars / CHARS_PER_TOKEN_ESTIMATE)
    return text, estimate + PER_MESSAGE_OVERHEAD * len(messages) + TEMPLATE_OVERHEAD


def parse(kind: Kind, body: Any, limits: Limits, default_model: str | None) -> ClientRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    body = dict(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    model = body.get("model", default_model)
    if kind != "generate" and (not isinstance(model, str) or not model):
        raise bad_request("'model' is required", "model")
    if kind == "generate" and model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    n = body.get("n", 1)
    if n != 1:
        raise bad_request("only n=1 is supported", "n")

    if kind == "generate":
        return _parse_generate(body, stream, model, limits)

    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not stream):
        raise bad_request(
            "'stream_options' must be an object and needs stream: true", "stream_options"
        )
    wants_usage = bool(opts and opts.get("include_usage"))
    if kind == "chat":
        prompt, estimate = _chat_prompt(body.get("messages"))
        asked = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
        body.pop("max_completion_tokens", None)
    else:
        p = body.get("prompt")
        if isinstance(p, str):
            prompt = p
        elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) > 1:
                raise bad_request("only one prompt per request is supported", "prompt")
            prompt = p[0]
        elif (
            isinstance(p, list)
            and p
            and all(isinstance(x, int) and not isinstance(x, bool) for x in p)
        ):
            prompt = " ".join(map(str, p))
        else:
            raise bad_request("'prompt' must be a string or a list of token ids", "prompt")
        estimate = (
            len(p) if isinstance(p, list) and isinstance(p[0], int) else estimate_tokens(prompt)
        )
        asked = _int(body, "max_tokens", 1)
    max_tokens = _cap(asked, limits, "max_tokens")
    body["max_tokens"] = max_tokens
    if stream:
        body["stream_options"] = {**(opts or {}), "include_usage": True}
    assert isinstance(model, str)
    return ClientRequest(kind, model, stream, wants_usage, max_tokens, prompt, estimate, body)


def _parse_generate(
    body: dict[str, Any], stream: bool, model: str | None, limits: Limits
) -> ClientRequest:
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, str) and ids is None:
        prompt, estimate = text, estimate_tokens(text)
    elif (
        text is None
        and isinstance(ids, list)
        and ids
        and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        prompt, estimate = " ".join(map(str, ids)), len(ids)
    else:
        raise bad_request("give either 'text' (a string) or 'input_ids' (a list of token ids)")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise bad_request("'sampling_params' must be an object", "sampling_params")
    asked = _int(sp, "max_new_tokens", 1)
    max_tokens = _cap(
        asked if asked is not None else GENERATE_DEFAULT_MAX_NEW_TOKENS,
        limits,
        "sampling_params.max_new_tokens",
    )
    body["sampling_params"] = {**sp, "max_new_tokens": max_tokens}
    body.pop("model", None)  # not an SGLang field
    if model is None:
        raise GatewayError(
            400, "this gateway serves several models: add 'model' to the body", param="model"
        )
    return ClientRequest("generate", model, stream, True, max_tokens, prompt, estimate, body)


def _cap(asked: int | None, limits: Limits, param: str) -> int:
    if asked is None:
        return limits.default_max_tokens or limits.max_tokens or FALLBACK_MAX_TOKENS
    if limits.max_tokens is not None and asked > limits.max_tokens:
        raise bad_request(
            f"{param}={asked} is above this key's limit of {limits.max_tokens}", param
        )
    return asked


def check_context(req: ClientRequest, context_length: int | None) -> None:
    if context_length is None:
        return
    if req.max_tokens >= context_length:
        raise bad_request(
            f"max_tokens={req.max_tokens} does not fit the model's context of "
            f"{context_length} tokens",
            "max_tokens",
        )
