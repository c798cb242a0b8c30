"""The admission bound, as a property: whatever a request contains, `inbound.parse` either
refuses it with a 4xx or reserves at least what a chat template can make of it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_gateway.allowlist import ALLOWED, GOVERNED
from kvfleet_gateway.config import Limits
from kvfleet_gateway.errors import GatewayError
from kvfleet_gateway.inbound import decode, parse
from kvfleet_sim.tokenizer import Tokenizer

TOKENIZER = Tokenizer(128_256)
text = st.text(st.characters(codec=None), max_size=300) | st.sampled_from(
    ["\ud800", "a\udfffb", " word" * 50, "<|eot_id|>" * 5, "\x00\x01", "é" * 40]
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": text})
message = st.fixed_dictionaries(
    {"role": text | st.sampled_from(["user", "system", "assistant"])},
    optional={
        "content": text | st.lists(part, max_size=3) | json_values,
        "name": text,
        "tool_calls": json_values,
        "tool_call_id": text,
        "bogus": json_values,
    },
)
extra_keys = st.sampled_from(sorted(ALLOWED["chat"] | set(GOVERNED) | {"bogus", "rid", "n"}))
chat_bodies = st.fixed_dictionaries(
    {"model": st.just("m"), "messages": st.lists(message, max_size=4)},
    optional={
        "tools": json_values,
        "chat_template_kwargs": json_values,
        "max_tokens": st.integers(-5, 10_000) | text,
        "stream": st.booleans() | text,
    },
).flatmap(
    lambda body: st.dictionaries(extra_keys, json_values, max_size=3).map(
        lambda extra: {**extra, **body}
    )
)


valid_message = st.fixed_dictionaries(
    {"role": text, "content": text | st.lists(part.map(lambda p: {**p, "type": "text"}))},
    optional={"name": text, "tool_calls": json_values, "tools": json_values},
)
valid_bodies = st.fixed_dictionaries(
    {"model": st.just("m"), "messages": st.lists(valid_message, min_size=1, max_size=4)},
    optional={
        "tools": json_values,
        "tool_choice": json_values,
        "chat_template_kwargs": st.dictionaries(text, json_values, max_size=3),
        "max_tokens": st.integers(1, 8192),
    },
)
"""Mostly accepted (a lone surrogate or an odd shape still gets refused)."""


def worst_template(body: dict[str, Any]) -> str:
    """Every string a template could read, once, plus the tool schemas re-rendered as
    indented JSON, plus a generous share of fixed template text."""
    parts = ["<|begin_of_text|>"]
    for m in body["messages"]:
        parts.append("<|start_header_id|>" + json.dumps(m, ensure_ascii=False) + "<|eot_id|>")
    for key in ("tools", "tool_choice", "chat_template_kwargs"):
        if body.get(key) is not None:
            parts.append(json.dumps(body[key], ensure_ascii=False))
    if body.get("tools") is not None:
        parts.append(json.dumps(body["tools"], ensure_ascii=False, indent=4))
    parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


@settings(max_examples=1000, deadline=None)
@given(chat_bodies | valid_bodies)
def test_parse_refuses_with_4xx_or_reserves_an_upper_bound(body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \ud800
    try:
        req = parse("chat", decode(raw), Limits(max_tokens=8192), None)
    except GatewayError as err:
        refused = err
    else:
        refused = None
    if refused is not None:
        assert 400 <= refused.status < 500
        return
    rendered = worst_template(json.loads(req.wire))
    assert TOKENIZER.count(rendered) <= req.prompt_bound
    assert req.reserve_tokens == req.prompt_bound + req.max_tokens
    assert json.loads(req.wire)["max_tokens"] == req.max_tokens


@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_decode_or_get_a_400(raw: bytes) -> None:
    try:
        body: object = decode(raw)
    except GatewayError as err:
        body = err
    assert isinstance(body, dict) or (isinstance(body, GatewayError) and body.status == 400)


def test_deep_nesting_is_a_400_not_a_recursion_error() -> None:
    # 100,000 brackets: refused by their count before decoding; 50 levels: by the depth walk.
    for raw, why in [(b"[" * 100_000, "holds 100,000 JSON objects and arrays"),
                     (b'{"a":' * 50 + b"1" + b"}" * 50, "nests deeper")]:  # fmt: skip
        with pytest.raises(GatewayError, match=why) as refused:
            decode(raw)
        assert refused.value.status == 400


def test_a_body_of_many_small_nested_lists_is_refused_in_milliseconds() -> None:
    """35,000 lists of 20 levels (1.4 MB): 0.84 s of json.loads and a long walk, once; now a
    count of their brackets. A prompt full of brackets inside its text is not refused."""
    import time

    bomb = b'{"x": [' + b",".join([b"[" * 20 + b"]" * 20] * 35_000) + b"]}"
    # CPU time, not wall time: what a refusal costs the gateway, whatever else runs beside.
    started = time.process_time()
    with pytest.raises(GatewayError, match=r"requests\.maxJsonContainers"):
        decode(bomb)
    assert time.process_time() - started < 0.1
    code = json.dumps({"prompt": "def f(x): return [x[i] for i in {1: [2]}] " * 5_000})
    assert decode(code.encode())["prompt"].startswith("def f(x)")
