"""What a chat template renders larger than the client sent it, for the prompt bound
(`inbound`): the bytes beyond a field's compact JSON in the body.

* Tool schemas are rendered a second time as indented JSON (4 spaces a level, as Llama
  3.1's template does; Qwen's compact `tojson` is smaller), after the engine has added the
  fields a client left out (SGLang dumps each tool through its pydantic model:
  `description`, `parameters`, `defer_loading` as nulls).
* An assistant's tool-call arguments are parsed by the engine (a JSON string becomes an
  object) and rendered with `tojson`: a space after every comma and colon (`[1,1]` becomes
  `[1, 1]`), so 2,000 small numbers once prefilled 6,056 tokens on a bound of 4,254.
"""

from __future__ import annotations

import json
from typing import Any

PER_TOOL_OVERHEAD = 128
"""The fields an engine adds to each tool before the template renders it (nulls for what the
client left out), indented."""
TOOL_INDENT = 4
"""Spaces per level of the indented JSON a template renders tool schemas as."""


def _utf8(text: str) -> int:
    """Bytes of `text`, a lone surrogate counted as its 3 (the body is refused for it when
    it is encoded, a 400, not a crash while it is measured)."""
    return len(text.encode("utf-8", "surrogatepass"))


def tools_bytes(tools: Any) -> int:
    """Bytes of `tools` as a template renders them the second time: each tool as indented
    JSON, with what the engine adds to it."""
    items = tools if isinstance(tools, list) else [tools]
    indented = sum(_utf8(json.dumps(t, ensure_ascii=False, indent=TOOL_INDENT)) for t in items)
    return indented + PER_TOOL_OVERHEAD * len(items)


def _rendered_arguments(arguments: Any) -> int:
    """Bytes of tool-call `arguments` beyond their JSON in the body, once the engine has
    parsed them (a string of JSON) and a template renders them with `tojson`."""
    value = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):
            return 0  # not JSON (to the engine's parser either): it refuses the request
    rendered = _utf8(json.dumps(value, ensure_ascii=False))
    return max(
        0, rendered - _utf8(json.dumps(arguments, separators=(",", ":"), ensure_ascii=False))
    )


def rerendered(message: dict[str, Any]) -> int:
    """What a template renders of `message` beyond its JSON in the body."""
    extra = 0 if message.get("tools") is None else tools_bytes(message["tools"])
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and "arguments" in function:
            extra += _rendered_arguments(function["arguments"])
    return extra
