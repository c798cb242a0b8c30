"""How many prompt tokens an SGLang engine prefills for a forwarded body, counted by code the
gateway does not share: the model's own chat template (its `tokenizer_config.json`) rendered
by `transformers`' `apply_chat_template`, and its `tokenizer.json` run by Hugging Face
`tokenizers` — the calls SGLang's chat serving makes.

What SGLang does to a chat body before the template is restated here, only where it changes
what is rendered: a tool is its pydantic model dumped (the `description`, `parameters` and
`defer_loading` a client left out become nulls), an assistant's tool-call arguments given
as a JSON string are parsed into the object the template re-serializes, text parts are
joined with spaces, a missing content is `""`, and the request's `reasoning_effort` and
`chat_template_kwargs` become keyword arguments of the template.

A body the engine would refuse (its template raises, arguments that are not JSON) prefills
nothing: `prefill_tokens` returns None for it.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from transformers import AutoTokenizer

TINY_CHAT = Path(__file__).parents[1] / "data" / "tokenizers" / "tiny-chat"


@cache
def _tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(TINY_CHAT))


def vocab_size() -> int:
    return len(_tokenizer())


def _tool(tool: Any) -> Any:
    """SGLang's `Tool.model_dump()`: defaults the client left out are rendered as nulls."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        return tool
    function = {"description": None, "parameters": None, **tool["function"]}
    return {"type": "function", **tool, "function": function, "defer_loading": None}


def _message(m: dict[str, Any]) -> dict[str, Any]:
    m = {k: v for k, v in copy.deepcopy(m).items() if v is not None}
    content = m.get("content")
    if isinstance(content, list):
        m["content"] = " ".join(p.get("text") or p.get("thinking") or "" for p in content)
    m.setdefault("content", "")
    for call in m.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            function["arguments"] = json.loads(function["arguments"])
    return m


def chat_text(wire: dict[str, Any]) -> str | None:
    """The prompt text the engine renders for the chat body `wire` (None: it refuses it)."""
    kwargs = dict(wire.get("chat_template_kwargs") or {})
    if wire.get("reasoning_effort") is not None:
        kwargs.setdefault("reasoning_effort", wire["reasoning_effort"])
    tools = wire.get("tools")
    try:
        messages = [_message(m) for m in wire["messages"]]
        text = _tokenizer().apply_chat_template(
            messages,
            tools=[_tool(t) for t in tools] if isinstance(tools, list) and tools else None,
            tokenize=False,
            add_generation_prompt=True,
            **kwargs,
        )
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError):
        return None  # SGLang answers these with a 400: nothing is prefilled
    assert isinstance(text, str)
    return text


def text_tokens(text: str, special: bool) -> int:
    """Tokens of `text`; `special`: with the tokenizer's own added special tokens (a plain
    prompt), else as a rendered template is encoded."""
    return len(_tokenizer().encode(text, add_special_tokens=special))


def prefill_tokens(kind: str, wire: dict[str, Any]) -> int | None:
    """The prompt tokens the engine prefills for the forwarded body `wire` of `kind`."""
    if kind == "chat":
        text = chat_text(wire)
        if text is None:
            return None
        return text_tokens(text, special=False) + len(wire.get("input_ids", []))
    if kind == "generate":
        if "input_ids" in wire:
            return len(wire["input_ids"])
        return text_tokens(wire["text"], special=True)
    prompt = wire["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    if isinstance(prompt, list):
        prompt = "".join(prompt)
    return text_tokens(prompt + wire.get("suffix", ""), special=True)
