"""What an engine's replies say, read without trusting them: SSE framing, token counts,
generated text, and the error event the gateway ends a broken stream with."""

from __future__ import annotations

import json
import math
from typing import Any

from kvfleet_gateway.metrics import Usage


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Whole SSE events (each ends with a blank line) and the incomplete rest."""
    events: list[bytes] = []
    while (end := buffer.find(b"\n\n")) >= 0:
        events.append(buffer[: end + 2])
        buffer = buffer[end + 2 :]
    return events, buffer


def count(value: Any) -> int:
    """A token count from an engine: an integer, else 0 (engines are not trusted)."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return int(value)
    return 0


def usage(kind: str, payload: Any) -> Usage | None:
    if not isinstance(payload, dict):
        return None
    if kind == "generate":
        meta = payload.get("meta_info")
        if isinstance(meta, dict) and "completion_tokens" in meta:
            return Usage(
                count(meta.get("prompt_tokens")),
                count(meta["completion_tokens"]),
                count(meta.get("cached_tokens")),
            )
        return None
    u = payload.get("usage")
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    cached = count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    return Usage(count(u.get("prompt_tokens")), count(u.get("completion_tokens")), cached)


def content(kind: str, payload: dict[str, Any]) -> str | None:
    """The new text in a chunk (None for chunks that carry no generated text)."""
    choices = payload.get("choices")
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        return None
    c = choices[0]
    if kind == "chat":
        delta = c.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else None
    else:
        text = c.get("text")
    return text if isinstance(text, str) and text else None


def error_event(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "code": "upstream_error"}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
