"""The request-field fuzz test (issue 55): over every generation endpoint, for any body the
gateway accepts, the body it forwards (`ClientRequest.wire`, the bytes the proxy posts to the
engine) asks the engine for no more work than was reserved and bounded — prompt tokens,
generated tokens, logprob alternatives, grammar bytes, token ids — and holds only fields of
the endpoint's typed allow-list, each of its JSON type.

The prompt tokens are judged by a referee the gateway does not share: the forwarded body
rendered by the test model's own chat template through `transformers` and counted by its
`tokenizers` tokenizer, as SGLang's chat serving does (`tests.support.engine_prefill`)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvfleet_gateway.allowlist import GOVERNED
from kvfleet_gateway.config import Limits, Requests, WorkBounds
from kvfleet_gateway.errors import GatewayError
from kvfleet_gateway.field_types import (
    CHAT_TEMPLATE_KWARGS,
    DESCRIBE,
    SAMPLING_PARAM_TYPES,
    TYPES,
)
from kvfleet_gateway.inbound import Kind, decode, parse
from tests.support.engine_prefill import prefill_tokens

VOCAB = 1_000
BOUNDS = WorkBounds()
REQUESTS = Requests(allow=tuple(GOVERNED))  # every governed extra on: the widest gateway
BIG_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(800)}}

scalar = (
    st.integers(-5, 200_000)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
    | st.none()
    | st.sampled_from(["100000", "1e5", "true", "hot", "x" * 300, "", "low"])
    | st.text(max_size=20)
)
value = st.recursive(
    scalar,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
ids = st.lists(st.integers(-3, VOCAB + 3), max_size=6)
response_format = st.sampled_from(
    [
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": BIG_SCHEMA}},
        {"type": "json_schema", "json_schema": {}, "schema": BIG_SCHEMA},
        {"type": "structural_tag", "triggers": ["<f"],
         "structures": [{"begin": "<f>", "schema": BIG_SCHEMA, "end": "</f>"}]},
        {"type": "structural_tag", "triggers": ["<f"],
         "structures": [{"begin": "<f>", "schema": {"type": "string"}, "end": "</f>"}]},
        {"type": "regex"},
    ]
)  # fmt: skip
AMPLIFIER = "{% for i in range(3000) %}hello world {% endfor %}"
"""52 bytes of template that render 6,000 words: what `chat_template` in the kwargs does."""
template_kwargs = st.dictionaries(
    st.sampled_from([*CHAT_TEMPLATE_KWARGS, "chat_template", "tools", "documents", "x"]),
    value | st.sampled_from([AMPLIFIER, True, False, "high"]),
    max_size=3,
)
TINY_TOOL = {"type": "function", "function": {"name": "f"}}
tools = st.sampled_from(
    [
        [TINY_TOOL],
        [TINY_TOOL] * 300,  # each one dumped with its defaults, then indented
        [{"type": "function", "function": {"name": "f", "description": "look it up",
                                           "parameters": BIG_SCHEMA}}],
    ]
)  # fmt: skip
arguments = st.sampled_from(
    ['{"q": "x"}', json.dumps({"xs": [1] * 2_000}, separators=(",", ":")), '{"s": "\\u00e9"}']
) | st.dictionaries(st.text(max_size=5), st.integers(), max_size=3)
"""A tool call's arguments: a JSON string the engine parses and the template re-serializes
(with a space after each comma), or an object."""
tool_call = st.fixed_dictionaries(
    {"id": st.just("c1"), "type": st.just("function"),
     "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "lookup"]),
                                        "arguments": arguments})}
)  # fmt: skip
words = st.text(max_size=40) | st.sampled_from(["hello there", " word" * 50, "é" * 40])
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": words})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "tool"]),
     "content": words | st.lists(text_part, min_size=1, max_size=3)}
) | st.fixed_dictionaries(
    {"role": st.just("assistant"), "content": words | st.none()},
    optional={"tool_calls": st.lists(tool_call, max_size=3)},
)  # fmt: skip
messages = st.lists(message, min_size=1, max_size=4)
special: dict[str, st.SearchStrategy[Any]] = {
    "response_format": response_format,
    "chat_template_kwargs": template_kwargs,
    "input_ids": ids,
    "stop_token_ids": ids,
    "token_ids_logprob": ids,
    "logit_bias": st.dictionaries(st.integers(-1, VOCAB + 2).map(str), scalar, max_size=3),
    "regex": st.sampled_from(["a+", "(a|b)" * 5_000]),
    "json_schema": st.sampled_from(['{"type": "string"}', json.dumps(BIG_SCHEMA)]),
    "tools": tools,
    "stream_options": st.dictionaries(st.sampled_from(["include_usage", "x"]), value, max_size=2),
}  # fmt: skip


BY_TYPE: dict[str, st.SearchStrategy[Any]] = {
    "an integer": st.integers(-3, 200_000) | st.sampled_from([0, 1, 20, 21]),
    "a number": st.floats(-3, 3, allow_nan=False),
    "a boolean": st.booleans(),
    "a string": st.text(max_size=20),
    "a string or an array of strings": st.text(max_size=20) | st.lists(st.text(max_size=300)),
    "an array of integers": ids,
    "an object": st.dictionaries(st.text(max_size=8), value, max_size=3),
    "a string, an array of strings or an array of token ids": st.text(max_size=40) | ids,
}
"""Values of a field's own JSON type (else most bodies would be refused for their types)."""
TYPE_OF = {name: DESCRIBE[check] for kind in TYPES.values() for name, check in kind.items()}
TYPE_OF |= {f"sp.{name}": DESCRIBE[check] for name, check in SAMPLING_PARAM_TYPES.items()}


def field_value(name: str) -> st.SearchStrategy[Any]:
    """Mostly a value of the field's type (or its hostile special cases), sometimes any."""
    typed = special.get(name.removeprefix("sp."), BY_TYPE.get(TYPE_OF.get(name, ""), value))
    return st.one_of(typed, typed, typed, value)


def extras(names: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    pool = sorted({*names, "rid", "bootstrap_host", "schema", "chat_template"})
    return st.lists(st.sampled_from(pool), max_size=6, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: field_value(k) for k in keys})
    )


bodies: dict[Kind, st.SearchStrategy[dict[str, Any]]] = {
    "chat": st.tuples(extras(sorted(TYPES["chat"])), messages).map(
        lambda t: {**t[0], "model": "m", "messages": t[1]}
    ),
    "completion": extras(sorted(TYPES["completion"])).map(
        lambda e: {"prompt": "hello there", **e, "model": "m"}
    ),
    "generate": st.tuples(
        extras(sorted(TYPES["generate"])),
        st.lists(st.sampled_from(sorted(SAMPLING_PARAM_TYPES)), max_size=4, unique=True).flatmap(
            lambda keys: st.fixed_dictionaries({k: field_value(f"sp.{k}") for k in keys})
        ),
    ).map(lambda t: {"text": "hello there", **t[0], "sampling_params": t[1]}),
}


def grammar_bytes(value: Any) -> int:
    return len(value.encode() if isinstance(value, str) else json.dumps(value).encode())


def check_forwarded(
    kind: Kind, wire: dict[str, Any], reserved_prompt: int, max_tokens: int
) -> None:
    """What the engine is asked for by `wire`, against what was reserved and bounded."""
    assert set(wire) <= set(TYPES[kind])
    sampling = wire["sampling_params"] if kind == "generate" else wire
    if kind == "generate":
        assert sampling["max_new_tokens"] == max_tokens
        assert sampling.get("min_new_tokens", 0) <= max_tokens
        assert set(sampling) <= set(SAMPLING_PARAM_TYPES)
        assert wire.get("top_logprobs_num", 0) <= BOUNDS.top_logprobs
    elif kind == "chat":
        assert wire["max_tokens"] == max_tokens and "max_completion_tokens" not in wire
        assert set(wire.get("chat_template_kwargs", {})) <= set(CHAT_TEMPLATE_KWARGS)
        assert wire.get("top_logprobs", 0) <= BOUNDS.top_logprobs
    else:
        assert wire["max_tokens"] == max_tokens
        assert wire.get("logprobs", 0) <= BOUNDS.top_logprobs
    prefill = prefill_tokens(kind, wire)  # None: the engine refuses the body
    assert prefill is None or prefill <= reserved_prompt, (prefill, reserved_prompt)
    assert sampling.get("n", 1) == 1 and wire.get("best_of", 1) == 1
    assert sampling.get("min_tokens", 0) <= max_tokens
    for name in ("regex", "ebnf", "json_schema"):
        if name in sampling:
            assert (
                isinstance(sampling[name], str)
                and grammar_bytes(sampling[name]) <= BOUNDS.grammar_bytes
            )
    if "response_format" in wire:
        assert grammar_bytes(wire["response_format"]) <= BOUNDS.grammar_bytes
    for name in ("input_ids", "stop_token_ids", "token_ids_logprob"):
        for i in sampling.get(name, []) if name == "stop_token_ids" else wire.get(name, []):
            assert type(i) is int and 0 <= i < VOCAB
    for k in sampling.get("logit_bias", {}):
        assert 0 <= int(k) < VOCAB


def accepted_or_refused(kind: Kind, body: dict[str, Any]) -> None:
    try:
        req = parse(kind, decode(json.dumps(body).encode()), Limits(max_tokens=4096), "m",
                    REQUESTS, VOCAB)  # fmt: skip
    except GatewayError as err:
        refused: GatewayError | None = err
    else:
        refused = None
        check_forwarded(kind, json.loads(req.wire), req.prompt_bound, req.max_tokens)
    assert refused is None or 400 <= refused.status < 500


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


LONG_ARGUMENTS = json.dumps({"xs": [1] * 2_000}, separators=(",", ":"))
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": LONG_ARGUMENTS}}
    ],
}


@settings(max_examples=400, deadline=None)
@given(bodies["chat"])
# The vectors the fuzzing found, or that each once passed a gateway: a template replaced
# through the kwargs, tools dumped and indented, tool-call arguments re-serialized.
@example(_chat(chat_template_kwargs={"chat_template": AMPLIFIER}))
@example(_chat(chat_template_kwargs={"enable_thinking": False}, reasoning_effort="high"))
@example(_chat(tools=[TINY_TOOL] * 300))
@example(_chat(messages=[{"role": "user", "content": "hi"}, CALLED]))
def test_chat_forwards_no_more_than_it_reserved(body: dict[str, Any]) -> None:
    accepted_or_refused("chat", body)


@settings(max_examples=400, deadline=None)
@given(bodies["completion"])
def test_completions_forward_no_more_than_they_reserved(body: dict[str, Any]) -> None:
    accepted_or_refused("completion", body)


@settings(max_examples=400, deadline=None)
@given(bodies["generate"])
def test_generate_forwards_no_more_than_it_reserved(body: dict[str, Any]) -> None:
    accepted_or_refused("generate", body)
