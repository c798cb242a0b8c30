"""One typed model, two views: frozen dataclasses → OpenAPI v3 (the CRD) and dict → dataclass.

A spec field is declared once, with its type, default and documentation:

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
import re
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Literal, Union, get_args, get_origin

import celpy
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError

Json = dict[str, Any]
"""A free-form Kubernetes object (affinity, a toleration): kept as given, not checked here."""


class SpecError(ValueError):
    """A spec that cannot be served; `path` names the field (e.g. `spec.engine.tensorParallel`)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path, self.message = path, message


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
) -> Any:
    """A documented spec field. `default` may be a zero-argument callable for containers."""
    meta = {
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
    return {str: {"type": "string"}, int: {"type": "integer"}, float: {"type": "number"}}.get(
        tp, {"type": "boolean"} if tp is bool else {}
    )


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
        default = _default_of(f)
        if default is MISSING and not optional:
            required.append(json_name(f))
        elif default is not MISSING and default is not None:
            # An object default of {} makes the API server fill the object's own defaults.
            schema["default"] = to_json(default)
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
            raise SpecError(path, "must be an object")
        return value
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed or type(value) is not type(allowed[0]):
            raise SpecError(path, f"{value!r} is not one of {', '.join(map(str, allowed))}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise SpecError(path, "must be a list")
        if meta.get("max_items") is not None and len(value) > meta["max_items"]:
            raise SpecError(path, f"more than {meta['max_items']} items")
        item = get_args(tp)[0]
        return tuple(_parse_value(item, v, f"{path}[{i}]", meta) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise SpecError(path, "must be an object")
        vt = get_args(tp)[1]
        return {str(k): _parse_value(vt, v, f"{path}.{k}", {}) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return parse(tp, value, path)  # type: ignore[arg-type]
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(path, f"{value!r} is not a boolean")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(path, f"{value!r} is not an integer")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SpecError(path, f"{value!r} is not a number")
        value = float(value)
    elif tp is str and not isinstance(value, str):
        raise SpecError(path, f"{value!r} is not a string")
    if meta.get("minimum") is not None and value < meta["minimum"]:
        raise SpecError(path, f"{value} is below the minimum {meta['minimum']}")
    if meta.get("maximum") is not None and value > meta["maximum"]:
        raise SpecError(path, f"{value} is above the maximum {meta['maximum']}")
    if meta.get("pattern") and not re.search(meta["pattern"], value):
        raise SpecError(path, f"{value!r} does not match {meta['pattern']}")
    if meta.get("max_length") is not None and len(value) > meta["max_length"]:
        raise SpecError(path, f"longer than {meta['max_length']} characters")
    return value


T = typing.TypeVar("T")


def parse(cls: type[T], data: Any, path: str = "spec") -> T:
    """Read `data` into `cls`, applying defaults; unknown fields and bad values are errors."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(path, "must be an object")
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    known = {json_name(f) for f in fields}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SpecError(f"{path}.{unknown[0]}", "unknown field")
    values = {}
    for f in fields:
        key = json_name(f)
        tp, optional = _unwrap_optional(hints[f.name])
        if data.get(key) is None:
            default = _default_of(f)
            if default is MISSING and not optional:
                raise SpecError(f"{path}.{key}", "required")
            if dataclasses.is_dataclass(tp) and default is not MISSING and default is not None:
                default = parse(tp, {}, f"{path}.{key}")  # type: ignore[arg-type]
            values[f.name] = None if default is MISSING else default
            continue
        values[f.name] = _parse_value(tp, data[key], f"{path}.{key}", f.metadata)
    obj = cls(**values)
    rules: tuple[Rule, ...] = getattr(cls, "RULES", ())
    if rules:
        document = to_json(obj)
        for r in rules:
            if not evaluate(r.rule, document):
                raise SpecError(path + (r.field_path or ""), r.message)
    return obj


# ---- CEL ----------------------------------------------------------------------------------------
@functools.cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def evaluate(rule: str, document: Json) -> bool:
    """A CEL rule with `self` bound to `document`, as the API server evaluates it."""
    try:
        result = _program(rule).evaluate({"self": json_to_cel(document)})
    except CELEvalError as exc:  # e.g. a missing field: the rule does not hold
        raise SpecError("spec", f"rule {rule!r} could not be evaluated: {exc}") from exc
    if isinstance(result, CELEvalError):
        raise SpecError("spec", f"rule {rule!r} could not be evaluated: {result}")
    return bool(result)
