"""One typed model, two views: frozen dataclasses → OpenAPI v3 and dict → dataclass.

The language both of kvfleet's documents are declared in: the InferenceService spec (the
operator's CRD) and the gateway config (the ConfigMap the operator renders); the tenant
limits are one model shared by both. A field is declared once, with its type, default and
documentation:

    tensor_parallel: Literal[1, 2, 4, 8] = fld(1, "GPUs per replica (SGLang --tp-size).")

`openapi(cls)` renders the structural schema the CRD carries (camelCase properties,
descriptions and defaults on every field, enums, bounds, patterns, CEL rules from the
class's `RULES`), and `parse(cls, data)` reads a custom resource's spec into the dataclass
with the same defaults and checks, naming the offending field on error. The API server
applies the schema; the operator parses again, evaluating the same CEL rules with
cel-python, because an old CRD, a server without CEL or a direct write may let something
through — and then the CR's `Ready` condition names the field.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Literal, Union, get_args, get_origin

Json = dict[str, Any]
"""A free-form Kubernetes object (affinity, a toleration): kept as given, not checked here."""


class ConfigError(ValueError):
    """A document that cannot be served; `path` names the field (e.g.
    `spec.engine.tensorParallel`, `limits.tenants[1].limits.maxTokens`)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path, self.message = path, message


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")
DURATION_PATTERN = r"^\d+(\.\d+)?[smhd]$"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class Duration(float):
    """Seconds, written as `30s`, `5m`, `1h`, `30d` (a bare positive number is seconds)."""

    @staticmethod
    def parse(value: Any, path: str) -> Duration:
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return Duration(value)
        m = _DURATION.match(value.strip()) if isinstance(value, str) else None
        if not m or float(m.group(1)) <= 0:
            raise ConfigError(path, f"{value!r} is not a duration like 30s, 1h, 1d, 30d")
        return Duration(float(m.group(1)) * _UNITS[m.group(2)])

    def __str__(self) -> str:
        for unit in ("d", "h", "m"):
            if self % _UNITS[unit] == 0:
                return f"{int(self // _UNITS[unit])}{unit}"
        return f"{float(self):g}s"


def yaml_position(exc: Exception) -> str:
    """Where a YAML error is, as `line L, column C` ("" when PyYAML does not say). Never the
    offending text: in a keys file it could be a secret."""
    mark = getattr(exc, "problem_mark", None)
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


@dataclass(frozen=True)
class Rule:
    """A CEL validation rule (`x-kubernetes-validations`) on the object it is declared on."""

    rule: str
    message: str
    field_path: str | None = None
    """Where the API server reports the violation, relative (e.g. `.maxReplicas`)."""


def fld(
    default: Any = MISSING,
    doc: str = "",
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    pattern: str | None = None,
    max_length: int | None = None,
    max_items: int | None = None,
    name: str | None = None,
    enum: tuple[str, ...] | None = None,
) -> Any:
    """A documented field. `default` may be a zero-argument callable for containers; `enum`
    lists a string's allowed values where they are known only at run time (a registry)."""
    meta = {
        "enum": enum,
        "doc": doc,
        "minimum": minimum,
        "maximum": maximum,
        "pattern": pattern,
        "max_length": max_length,
        "max_items": max_items,
        "name": name,
    }
    if callable(default):
        return dataclasses.field(default_factory=default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def json_name(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("name") or camel(f.name)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def to_json(value: Any) -> Any:
    """A dataclass value as the JSON its spec would be written in (camelCase, no Nones)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if v is not None:
                out[json_name(f)] = to_json(v)
        return out
    if isinstance(value, tuple | list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, Duration):
        return str(value)
    return value


# ---- OpenAPI ----------------------------------------------------------------------------------
def _type_schema(tp: Any) -> Json:
    if tp is Json or tp == dict[str, Any]:
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    origin = get_origin(tp)
    if origin is Literal:
        values = list(get_args(tp))
        kind = {bool: "boolean", int: "integer", float: "number", str: "string"}[type(values[0])]
        return {"type": kind, "enum": values}
    if origin is tuple:
        return {"type": "array", "items": _type_schema(get_args(tp)[0])}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(get_args(tp)[1])}
    if dataclasses.is_dataclass(tp):
        return openapi(tp)  # type: ignore[arg-type]
    if tp is Duration:
        return {"type": "string", "pattern": DURATION_PATTERN}
    return {str: {"type": "string"}, int: {"type": "integer"}, float: {"type": "number"}}.get(
        tp, {"type": "boolean"} if tp is bool else {}
    )


def _say_default(schema: Json, default: Any) -> None:
    """A scalar default in the field's description too (`Default: 4.`), as kubebuilder's
    generated CRDs write it: `kubectl explain` shows descriptions, not the `default` key."""
    if "description" not in schema or not isinstance(default, str | int | float):
        return
    shown = json.dumps(default) if isinstance(default, bool) else str(default)
    schema["description"] = f"{schema['description'].rstrip()} Default: {shown}."


def openapi(cls: type) -> Json:
    """The structural OpenAPI v3 schema of a spec dataclass."""
    hints = typing.get_type_hints(cls)
    props: Json = {}
    required = []
    for f in dataclasses.fields(cls):
        tp, optional = _unwrap_optional(hints[f.name])
        schema = _type_schema(tp)
        if f.metadata.get("doc"):  # the field's own words win over its type's docstring
            schema = {**schema, "description": f.metadata["doc"]}
            schema = {"description": schema.pop("description"), **schema}
        for key, meta in (
            ("minimum", "minimum"),
            ("maximum", "maximum"),
            ("pattern", "pattern"),
            ("maxLength", "max_length"),
        ):
            if f.metadata.get(meta) is not None:
                target = schema["items"] if schema.get("type") == "array" else schema
                target[key] = f.metadata[meta]
        if f.metadata.get("max_items") is not None:
            schema["maxItems"] = f.metadata["max_items"]
        if f.metadata.get("enum") is not None:
            schema["enum"] = list(f.metadata["enum"])
        default = _default_of(f)
        if default is MISSING and not optional:
            required.append(json_name(f))
        elif default is not MISSING and default is not None:
            # An object default of {} makes the API server fill the object's own defaults.
            schema["default"] = to_json(default)
            _say_default(schema, schema["default"])
        props[json_name(f)] = schema
    out: Json = {"type": "object", "properties": props}
    doc = (cls.__doc__ or "").strip()
    if doc and not doc.startswith(cls.__name__ + "("):
        out["description"] = " ".join(doc.split())
    if required:
        out["required"] = required
    rules: tuple[Rule, ...] = getattr(cls, "RULES", ())
    if rules:
        out["x-kubernetes-validations"] = [
            {"rule": r.rule, "message": r.message}
            | ({"fieldPath": r.field_path} if r.field_path else {})
            for r in rules
        ]
    return out


# ---- parsing ----------------------------------------------------------------------------------
def _parse_value(tp: Any, value: Any, path: str, meta: typing.Mapping[str, Any]) -> Any:
    if tp is Json or tp == dict[str, Any]:
        if not isinstance(value, dict):
            raise ConfigError(path, "must be an object")
        return value
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed or type(value) is not type(allowed[0]):
            raise ConfigError(path, f"{value!r} is not one of {', '.join(map(str, allowed))}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(path, "must be a list")
        if meta.get("max_items") is not None and len(value) > meta["max_items"]:
            raise ConfigError(path, f"more than {meta['max_items']} items")
        item = get_args(tp)[0]
        return tuple(_parse_value(item, v, f"{path}[{i}]", meta) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, "must be an object")
        vt = get_args(tp)[1]
        return {str(k): _parse_value(vt, v, join(path, str(k)), {}) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _parse(tp, value, path)  # type: ignore[arg-type]
    if tp is Duration:
        return Duration.parse(value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"{value!r} is not a boolean")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"{value!r} is not an integer")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"{value!r} is not a number")
        value = float(value)
    elif tp is str and not isinstance(value, str):
        raise ConfigError(path, f"{value!r} is not a string")
    if meta.get("minimum") is not None and value < meta["minimum"]:
        raise ConfigError(path, f"{value} is below the minimum {meta['minimum']}")
    if meta.get("maximum") is not None and value > meta["maximum"]:
        raise ConfigError(path, f"{value} is above the maximum {meta['maximum']}")
    if meta.get("enum") is not None and value not in meta["enum"]:
        raise ConfigError(path, f"{value!r} is not one of {', '.join(meta['enum'])}")
    if meta.get("pattern") and not re.search(meta["pattern"], value):
        raise ConfigError(path, f"{value!r} does not match {meta['pattern']}")
    if meta.get("max_length") is not None and len(value) > meta["max_length"]:
        raise ConfigError(path, f"longer than {meta['max_length']} characters")
    return value


T = typing.TypeVar("T")


def parse(cls: type[T], data: Any, path: str = "") -> T:
    """Read `data` into `cls`, applying defaults; unknown fields and bad values are errors.

    The result is a frozen value, so an equal document parses once: the operator parses every
    spec and the gateway config it renders on each reconcile, and the CEL rules alone cost
    milliseconds a document.
    """
    try:
        key = json.dumps(data, sort_keys=True)
    except (TypeError, ValueError):  # not a JSON document (a YAML date, say): no memo
        return _parse(cls, data, path)
    return typing.cast(T, _parse_document(cls, key, path))  # type: ignore[arg-type]


@functools.lru_cache(maxsize=256)
def _parse_document(cls: type[Any], document: str, path: str) -> Any:
    return _parse(cls, json.loads(document), path)


@functools.cache
def _field_table(cls: type[Any]) -> tuple[tuple[dataclasses.Field[Any], str, Any, bool], ...]:
    """Each field with its JSON name, its type and whether it may be null (resolving the
    type hints once per class: `typing.get_type_hints` re-evaluates every annotation)."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f, json_name(f), *_unwrap_optional(hints[f.name])) for f in dataclasses.fields(cls)
    )


def _parse(cls: type[T], data: Any, path: str) -> T:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, "must be an object")
    table = _field_table(cls)  # type: ignore[arg-type]
    unknown = sorted(set(data) - {key for _, key, _, _ in table})
    if unknown:
        raise ConfigError(join(path, unknown[0]), "unknown field")
    values = {}
    for f, key, tp, optional in table:
        if data.get(key) is None:
            default = _default_of(f)
            if default is MISSING and not optional:
                raise ConfigError(join(path, key), "required")
            if dataclasses.is_dataclass(tp) and default is not MISSING and default is not None:
                default = _parse(tp, {}, join(path, key))  # type: ignore[arg-type]
            values[f.name] = None if default is MISSING else default
            continue
        values[f.name] = _parse_value(tp, data[key], join(path, key), f.metadata)
    obj = cls(**values)
    rules: tuple[Rule, ...] = getattr(cls, "RULES", ())
    if rules:
        document = to_json(obj)
        for r in rules:
            if not evaluate(r.rule, document, path):
                raise ConfigError(
                    join(path, (r.field_path or "").lstrip(".")).rstrip("."), r.message
                )
    return obj


# ---- CEL ----------------------------------------------------------------------------------------
# celpy is imported on first use: it costs ~0.15 s at every start of a process that never
# evaluates a rule (a gateway pod, most `kvfleet` commands).
@functools.cache
def _program(rule: str) -> Any:
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def evaluate(rule: str, document: Json, path: str = "") -> bool:
    """A CEL rule with `self` bound to `document`, as the API server evaluates it."""
    from celpy.adapter import json_to_cel
    from celpy.evaluation import CELEvalError

    try:
        result = _program(rule).evaluate({"self": json_to_cel(document)})
    except CELEvalError as exc:  # e.g. a missing field: the rule does not hold
        raise ConfigError(path, f"rule {rule!r} could not be evaluated: {exc}") from exc
    if isinstance(result, CELEvalError):
        raise ConfigError(path, f"rule {rule!r} could not be evaluated: {result}")
    return bool(result)


# ---- reference documentation ------------------------------------------------------------------
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
            for k, m in (("≥", "minimum"), ("≤", "maximum"), ("max items", "max_items"))
            if f.metadata.get(m) is not None
        ]
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
