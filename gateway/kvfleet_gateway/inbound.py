"""What a client asked for: decoded, validated, bounded — all before anything is charged.

The admission reservation must be an upper bound of what the engine can bill, whatever the
request contains, or a budget can be overrun by one request (a 60,000-word `role` once
reserved 20 tokens and was billed 60,017). So the prompt side of the reservation is not an
estimate of the message text but a bound over *every byte the engine receives*:

* a byte-level BPE token (Llama 3, Qwen, Mistral with byte fallback) spans at least one byte
  of text, and a JSON encoding has at least one byte per byte of every string in it (escapes
  only add), so a template that renders each string of the fields it reads (`messages`,
  `tools`, `tool_choice`, `chat_template_kwargs`; `prompt` and `suffix`; `text`) at most once
  yields at most as many tokens as those fields' JSON has bytes, plus its own fixed text: a
  template overhead, a per-message header, and what a template renders larger than the
  client sent it (`rerendering`: tool schemas again as indented JSON with the fields the
  engine adds, plus a preamble; tool-call arguments re-serialized by `tojson`);
* what cannot be bounded that way is refused: media parts (an image URL of 30 bytes becomes
  thousands of tokens), `input_embeds`, `n` > 1, and fields outside the allow-list.

The completion side is bounded by the `max_tokens` the gateway always forwards. Both go into
the reservation, and settlement never bills beyond it (see `exchange.Exchange.billed_usage`), so
the tokens billed to a tenant never exceed its budget.

The forwarded body is encoded here, once: a string the engine could not decode (a lone UTF-16
surrogate, `"\\ud800"`) is a 400 now, not a crash after admission.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from kvfleet_gateway import engine_work
from kvfleet_gateway.allowlist import (
    ALLOWED,
    MESSAGE_FIELDS,
    SAMPLING_PARAMS,
    TEXT_PARTS,
    check_fields,
)
from kvfleet_gateway.config import Limits, Requests
from kvfleet_gateway.errors import GatewayError, bad_request
from kvfleet_gateway.field_types import (
    CHAT_TEMPLATE_KWARGS,
    SAMPLING_PARAM_TYPES,
    STREAM_OPTIONS,
    TYPES,
    check_object,
    check_types,
)
from kvfleet_gateway.rerendering import rerendered, tools_bytes

Kind = Literal["chat", "completion", "generate"]
FALLBACK_MAX_TOKENS = 1024
"""Injected when neither the client nor the tenant's limits give a max_tokens."""
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's own default for /generate
CHARS_PER_TOKEN_ESTIMATE = 3.0
"""For routing only (how much prefill a request brings): below the ~4 of English BPE."""
MAX_JSON_DEPTH = 32
"""Deeper bodies are refused: no OpenAI request nests that far, and recursion is not free."""
TEMPLATE_OVERHEAD = 64
"""Tokens a chat template adds once: begin-of-text, a default system preamble, the header
that opens the reply."""
PER_MESSAGE_OVERHEAD = 8
"""Role header, separators and end-of-turn of one message."""
TOOLS_OVERHEAD = 512
"""The instructions a template wraps tool schemas in."""
PROMPT_OVERHEAD = 8
"""Begin-of-text and similar, for prompts that bypass the chat template."""
_COMPACT = {"ensure_ascii": False, "separators": (",", ":")}
TEMPLATE_FIELDS: dict[Kind, frozenset[str]] = {
    "chat": frozenset({"messages", "tools", "tool_choice", "chat_template_kwargs", "input_ids"}),
    "completion": frozenset({"prompt", "suffix"}),
    "generate": frozenset({"text", "input_ids"}),
}
"""The fields whose text reaches the engine's tokenizer."""
TEMPLATE_KWARGS_WHY = (
    "the engine's template runner renders or executes what chat_template_kwargs holds "
    "(chat_template would replace the template), so only its switches are forwarded"
)
IDS_FIELD: dict[Kind, str] = {"chat": "input_ids", "completion": "prompt", "generate": "input_ids"}
"""Where a prompt given as token ids sits."""


@dataclass(frozen=True)
class EnginePrompt:
    """What the engine's tokenizer turns into the prompt, when the gateway can reproduce it
    (`kv_events.prompts`): chat messages for the chat template, prompt text, or token ids."""

    messages: tuple[tuple[str, str], ...] = ()
    text: str | None = None
    ids: tuple[int, ...] | None = None

    @property
    def chars(self) -> int:
        """Characters to tokenize (0 for token ids)."""
        if self.ids is not None:
            return 0
        if self.text is not None:
            return len(self.text)
        return sum(len(content) for _, content in self.messages)


@dataclass(frozen=True)
class ClientRequest:
    kind: Kind
    model: str
    stream: bool
    client_wants_usage: bool
    client_wants_continuous_usage: bool
    max_tokens: int
    prompt_text: str
    """The text routing hashes into prefix blocks."""
    estimated_prompt_tokens: int
    """A realistic prompt size, for routing decisions."""
    prompt_bound: int
    """An upper bound of the prompt tokens the engine can count for this body."""
    wire: bytes
    """The JSON body sent upstream."""
    engine_prompt: EnginePrompt | None = None
    """None: the engine's prompt cannot be reproduced here (tools, a template's extras)."""

    @property
    def reserve_tokens(self) -> int:
        return self.prompt_bound + self.max_tokens


def estimate_tokens(text: str) -> int:
    return _estimate(len(text))


def _estimate(chars: int) -> int:
    return math.ceil(chars / CHARS_PER_TOKEN_ESTIMATE)


def decode(raw: bytes, max_containers: int = 10_000) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says what is wrong with it. Its
    objects and arrays are counted first, at C speed on the bytes: a body of a million small
    nested lists is refused in milliseconds instead of taking a second to decode and walk."""
    containers = _containers(raw, max_containers)
    if containers > max_containers:
        raise bad_request(
            f"the request body holds {containers:,} JSON objects and arrays; this gateway "
            f"accepts at most {max_containers:,} (requests.maxJsonContainers)"
        )
    try:
        body = json.loads(raw, parse_constant=_not_a_number)
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:  # includes UnicodeDecodeError
        raise bad_request("the request body is not valid JSON (UTF-8)") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if not _depth_within(body, MAX_JSON_DEPTH):
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    return body


def _containers(raw: bytes, limit: int) -> int:
    """Objects and arrays in a JSON text, counted with a few C-speed passes over its bytes:
    its brackets, while that count is within `limit` (brackets inside strings then do not
    matter); past it, only those outside strings (escaped backslashes and quotes removed, the
    text split at the remaining quotes: every other piece is outside a string), so a prompt
    full of code is not refused for the brackets in its text."""
    rough = raw.count(b"[") + raw.count(b"{")
    if rough <= limit:
        return rough
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(plain.split(b'"')[::2])
    return outside.count(b"[") + outside.count(b"{")


def _not_a_number(name: str) -> Any:
    # Python reads NaN and Infinity (and would forward them as such); JSON has neither.
    raise bad_request(f"the request body has {name}, which is not a JSON number")


def _depth_within(value: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return False
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return True


def _encode(value: Any) -> bytes:
    try:
        return json.dumps(value, **_COMPACT).encode()  # type: ignore[arg-type]
    except UnicodeEncodeError:
        raise bad_request(
            "the request contains a string that is not valid Unicode (a lone UTF-16 surrogate)"
        ) from None


def _int(body: dict[str, Any], key: str, minimum: int, where: str = "") -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{where}{key}' must be an integer", where + key)
    if v < minimum:
        raise bad_request(f"'{where}{key}' must be at least {minimum}, got {v}", where + key)
    return v


def _one(body: dict[str, Any], key: str, where: str = "") -> None:
    """`n` and `best_of` multiply the work; the reservation covers one completion."""
    v = body.get(key)
    if v is not None and (isinstance(v, bool) or v != 1):
        raise bad_request(f"only {where}{key}=1 is supported", where + key)


def _token_ids(value: Any) -> list[int] | None:
    if (
        isinstance(value, list)
        and value
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    ):
        return value
    return None


def _chat_messages(
    messages: Any, req: Requests
) -> tuple[str, int, int, tuple[tuple[str, str], ...] | None]:
    """Routing text, its estimate, the bytes the template renders beyond the messages' JSON
    (message-level tools, tool-call arguments: `rerendering`), and the messages as a plain
    chat template sees them (None when any carries more than a role and text)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    parts: list[str] = []
    content_chars = 0
    tool_bytes = 0
    plain: list[tuple[str, str]] | None = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"{where} must be an object with a string 'role'", "messages")
        check_fields(f"{where}.", m, MESSAGE_FIELDS, frozenset(), req.unknown_fields == "drop")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, p in enumerate(content):
                kind = p.get("type") if isinstance(p, dict) else None
                if kind not in TEXT_PARTS:
                    raise bad_request(
                        f"{where}.content[{j}]: content parts of type {kind!r} are not "
                        "accepted: only text parts can be bounded for token budgets",
                        "messages",
                    )
                text = p.get("text", p.get("thinking"))
                if not isinstance(text, str):
                    raise bad_request(f"{where}.content[{j}] needs a string 'text'", "messages")
                texts.append(text)
            content = "".join(texts)
        if content is not None and not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string or a list of parts", "messages")
        tool_bytes += rerendered(m)
        content_chars += len(content or "")
        parts.append(f"{m['role']}: {content or ''}\n")
        if plain is not None and set(m) <= {"role", "content"} and isinstance(content, str):
            plain.append((m["role"], content))
        else:
            plain = None
    return "".join(parts), _estimate(content_chars), tool_bytes, tuple(plain) if plain else None


def parse(
    kind: Kind,
    body: dict[str, Any],
    limits: Limits,
    default_model: str | None,
    requests: Requests | None = None,
    vocab_size: int | None = None,
) -> ClientRequest:
    """The request `body` asks for, checked, bounded and re-encoded for the engine;
    `vocab_size`: the model's vocabulary, which bounds token ids (None: not known, and token
    ids are refused)."""
    req = requests or Requests()
    body = dict(body)
    check_fields("", body, ALLOWED[kind], frozenset(req.allow), req.unknown_fields == "drop")
    check_types("", body, TYPES[kind])
    stream = body.get("stream", False)
    model = body.get("model", default_model)
    if kind != "generate" and (not isinstance(model, str) or not model):
        raise bad_request("'model' is required", "model")
    if kind == "generate" and model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    _one(body, "n")
    _one(body, "best_of")

    if kind == "generate":
        return _parse_generate(body, stream, model, limits, req, vocab_size)

    opts = body.get("stream_options")
    if opts is not None and not stream:
        raise bad_request("'stream_options' needs stream: true", "stream_options")
    if opts is not None:
        check_object("stream_options.", opts, STREAM_OPTIONS, "not an OpenAI stream option")
    if body.get("chat_template_kwargs") is not None:
        check_object("chat_template_kwargs.", body["chat_template_kwargs"],
                     CHAT_TEMPLATE_KWARGS, TEMPLATE_KWARGS_WHY)  # fmt: skip
    wants_usage = bool(opts and opts.get("include_usage"))
    wants_continuous = bool(opts and opts.get("continuous_usage_stats"))
    overhead = PROMPT_OVERHEAD
    ids: list[int] | None = None
    engine_prompt: EnginePrompt | None = None
    if kind == "chat":
        prompt, estimate, tool_bytes, plain = _chat_messages(body.get("messages"), req)
        if body.get("tools") is not None:
            tool_bytes += tools_bytes(body["tools"])
        if plain is not None and not (TEMPLATE_FIELDS["chat"] - {"messages"}) & body.keys():
            engine_prompt = EnginePrompt(messages=plain)
        overhead = TEMPLATE_OVERHEAD + PER_MESSAGE_OVERHEAD * len(body["messages"])
        if tool_bytes:
            overhead += TOOLS_OVERHEAD + tool_bytes
        asked = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
        body.pop("max_completion_tokens", None)
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            prompt, estimate = p, estimate_tokens(p)
            engine_prompt = EnginePrompt(text=p) if body.get("suffix") is None else None
        elif (ids := _token_ids(p)) is not None:
            prompt, estimate = " ".join(map(str, ids)), len(ids)
            engine_prompt = EnginePrompt(ids=tuple(ids))
        elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, str) for x in p):
            raise bad_request("only one prompt per request is supported", "prompt")
        else:
            raise bad_request("'prompt' must be a string or a list of token ids", "prompt")
        asked = _int(body, "max_tokens", 1)
    max_tokens = _cap(asked, limits, "max_tokens")
    body["max_tokens"] = max_tokens
    engine_work.check(kind, body, max_tokens, req.bounds)
    engine_work.check_token_ids(kind, body, vocab_size)
    if stream:
        # Usage in every chunk: a stream cut short is still billed from the engine's counts.
        body["stream_options"] = {
            **(opts or {}),
            "include_usage": True,
            "continuous_usage_stats": True,
        }
    assert isinstance(model, str)
    wire = _encode(body)
    bound = _bound(kind, body, wire, ids) + overhead
    return ClientRequest(
        kind,
        model,
        stream,
        wants_usage,
        wants_continuous,
        max_tokens,
        prompt,
        estimate,
        bound,
        wire,
        engine_prompt,
    )


def _bound(kind: Kind, body: dict[str, Any], wire: bytes, ids: list[int] | None) -> int:
    """The JSON bytes of the fields the tokenizer sees (the body's, less the others'), where
    a token-id list counts one per id rather than its digits."""
    rest = {k: v for k, v in body.items() if k not in TEMPLATE_FIELDS[kind]}
    n = len(wire) - len(_encode(rest))
    if ids is not None:
        n += len(ids) - len(_encode(body[IDS_FIELD[kind]]))
    return max(0, n)


def _parse_generate(
    body: dict[str, Any],
    stream: bool,
    model: str | None,
    limits: Limits,
    req: Requests,
    vocab_size: int | None,
) -> ClientRequest:
    text, ids = body.get("text"), _token_ids(body.get("input_ids"))
    if isinstance(text, str) and body.get("input_ids") is None:
        prompt, estimate = text, estimate_tokens(text)
        engine_prompt = EnginePrompt(text=text)
    elif text is None and ids is not None:
        prompt, estimate = " ".join(map(str, ids)), len(ids)
        engine_prompt = EnginePrompt(ids=tuple(ids))
    else:
        raise bad_request("give either 'text' (a string) or 'input_ids' (a list of token ids)")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise bad_request("'sampling_params' must be an object", "sampling_params")
    sp = dict(sp)
    check_fields(
        "sampling_params.",
        sp,
        SAMPLING_PARAMS,
        frozenset(req.allow),
        req.unknown_fields == "drop",
    )
    check_types("sampling_params.", sp, SAMPLING_PARAM_TYPES)
    _one(sp, "n", "sampling_params.")
    asked = _int(sp, "max_new_tokens", 1, "sampling_params.")
    max_tokens = _cap(
        asked if asked is not None else GENERATE_DEFAULT_MAX_NEW_TOKENS,
        limits,
        "sampling_params.max_new_tokens",
    )
    body["sampling_params"] = {**sp, "max_new_tokens": max_tokens}
    engine_work.check("generate", body, max_tokens, req.bounds)
    engine_work.check_token_ids("generate", body, vocab_size)
    body.pop("model", None)  # not an SGLang field
    if model is None:
        raise GatewayError(
            400, "this gateway serves several models: add 'model' to the body", param="model"
        )
    wire = _encode(body)
    bound = _bound("generate", body, wire, ids) + PROMPT_OVERHEAD
    return ClientRequest(
        "generate",
        model,
        stream,
        True,
        True,
        max_tokens,
        prompt,
        estimate,
        bound,
        wire,
        None if body.get("lora_path") is not None else engine_prompt,
    )


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
