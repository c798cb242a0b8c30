"""Reference documentation of a spec model: every field of a dataclass (nested ones by
path) with its type, default, bounds and description, then the rules between fields — what
`make docs` writes, generated from the same model the CRD and the parser come from."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import MISSING
from typing import Any, Literal, get_args, get_origin

from kvfleet_kernel.schema import (
    Duration,
    Json,
    _default_of,
    _unwrap_optional,
    join,
    json_name,
    to_json,
)


def _type_name(tp: Any, meta: typing.Mapping[str, Any]) -> str:
    tp, _ = _unwrap_optional(tp)
    origin = get_origin(tp)
    if meta.get("enum"):
        return " \\| ".join(f"`{v}`" for v in meta["enum"])
    if origin is Literal:
        return " \\| ".join(f"`{v}`" for v in get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(get_args(tp)[0], {})}"
    if tp is Json or tp == dict[str, Any]:
        return "object"
    if origin is dict:
        return f"map of {_type_name(get_args(tp)[1], {})}"
    if tp is Duration:
        return "duration (`30s`, `5m`, `1h`, `30d`)"
    if dataclasses.is_dataclass(tp):
        return "object"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(tp, str(tp))


def _rows(cls: type, prefix: str, out: list[str], rules: list[str]) -> None:
    hints = typing.get_type_hints(cls)
    for r in getattr(cls, "RULES", ()):
        rules.append(f"- `{prefix or '.'}`: {r.message} (`{r.rule}`)")
    for f in dataclasses.fields(cls):
        path = join(prefix, json_name(f))
        tp, _ = _unwrap_optional(hints[f.name])
        default = _default_of(f)
        shown = "required" if default is MISSING else "—" if default is None else default
        if dataclasses.is_dataclass(shown) or shown in ((), {}):
            shown = "—" if shown in ((), {}) else "(its fields' defaults)"
        elif isinstance(shown, bool):
            shown = f"`{str(shown).lower()}`"
        elif shown not in ("required", "—"):
            shown = f"`{to_json(shown)}`"
        bounds = [
            f"{k} {f.metadata[m]}"
            for k, m in (
                ("≥", "minimum"),
                ("≤", "maximum"),
                ("max items", "max_items"),
                ("max length", "max_length"),
            )
            if f.metadata.get(m) is not None
        ]
        unique = f.metadata.get("unique_by")
        if unique:
            bounds.append("each once" if unique == "." else f"each {unique} once")
        doc = " ".join(str(f.metadata.get("doc") or "").split()).replace("|", "\\|")
        note = f" ({', '.join(bounds)})" if bounds else ""
        out.append(
            f"| `{path}` | {_type_name(hints[f.name], f.metadata)} | {shown} | {doc}{note} |"
        )
        item = get_args(tp)[0] if get_origin(tp) is tuple else tp
        if dataclasses.is_dataclass(item) and isinstance(item, type):
            _rows(item, path + ("[]" if get_origin(tp) is tuple else ""), out, rules)


def reference(cls: type, title: str, intro: str, prefix: str = "") -> str:
    """Markdown: every field of `cls` (nested ones by path) with its type, default, bounds and
    description, then the rules between fields. Generated; never edited by hand."""
    out = [
        f"# {title}",
        "",
        "<!-- Generated from the typed model by `make docs`; a test fails when it is stale. -->",
        "",
        intro.strip(),
        "",
        "| field | type | default | description |",
        "|---|---|---|---|",
    ]
    rules: list[str] = []
    _rows(cls, prefix, out, rules)
    if rules:
        out += ["", "## Rules between fields", "", *rules]
    return "\n".join(out) + "\n"
