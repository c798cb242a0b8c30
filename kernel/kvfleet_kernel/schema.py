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

import copy
import dataclasses
import functools
import json
import re
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Literal, Union, get_args, get_origin

from kvfleet_kernel.memo import MISSING as MISSING_ENTRY
from kvfleet_kernel.memo import Memo

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
    message_expression: str | None = None
    """A CEL string expression naming what is wrong (the offending value), reported instead
    of `message` by the API server and the parser."""


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
    unique_by: str | None = None,
    item_rule: Rule | None = None,
) -> Any:
    """A documented field. `default` may be a zero-argument callable for containers; `enum`
    lists a string's allowed values where they are known only at run time (a registry).
    `unique_by` makes a list's items unique: by that key of each object (a list-type map,
    keyed by a required field), or by value (`"."`, a list-type set of scalars) — checked by
    the API server in linear time and by the parser, where a CEL rule would compare every
    pair. `item_rule` is a CEL rule on each item of a list (`self` the item): its estimated
    cost is one item's, where a rule walking the list costs the whole list's."""
    meta = {
        "unique_by": unique_by,
        "item_rule": item_rule,
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
        if f.metadata.get("item_rule") is not None:
            schema["items"]["x-kubernetes-validations"] = _validations((f.metadata["item_rule"],))
        if f.metadata.get("unique_by") == ".":
            schema["x-kubernetes-list-type"] = "set"
        elif f.metadata.get("unique_by"):
            schema["x-kubernetes-list-type"] = "map"
            schema["x-kubernetes-list-map-keys"] = [f.metadata["unique_by"]]
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
        out["x-kubernetes-validations"] = _validations(rules)
    return out


def _validations(rules: tuple[Rule, ...]) -> list[Json]:
    return [
        {"rule": r.rule, "message": r.message}
        | ({"messageExpression": r.message_expression} if r.message_expression else {})
        | ({"fieldPath": r.field_path} if r.field_path else {})
        for r in rules
    ]


# ---- parsing ----------------------------------------------------------------------------------
Docs = dict[int, Json]
"""The JSON document of each dataclass value parsed so far in one parse (by `id`): a rule on
an object reads its children's documents instead of converting their subtrees again."""


@functools.cache
def _kind(tp: Any) -> str:
    """How a field of type `tp` is read (resolved once per type: `get_origin`, comparing
    generic aliases and `is_dataclass` cost microseconds on each of thousands of items)."""
    if tp is Json or tp == dict[str, Any]:
        return "json"
    origin = get_origin(tp)
    if origin in (Literal, tuple, dict):
        return {Literal: "literal", tuple: "tuple", dict: "dict"}[origin]
    return "dataclass" if dataclasses.is_dataclass(tp) else "scalar"


def _parse_value(tp: Any, value: Any, path: str, meta: typing.Mapping[str, Any], docs: Docs) -> Any:
    kind = _kind(tp)
    if kind == "json":
        if not isinstance(value, dict):
            raise ConfigError(path, "must be an object")
        return copy.deepcopy(value)  # the caller's document stays the caller's
    if kind == "dataclass":
        return _parse(tp, value, path, docs)
    if kind == "scalar":
        return _scalar(tp, value, path, meta)
    if kind == "literal":
        allowed = get_args(tp)
        if value not in allowed or type(value) is not type(allowed[0]):
            raise ConfigError(path, f"{value!r} is not one of {', '.join(map(str, allowed))}")
        return value
    if kind == "tuple":
        if not isinstance(value, list):
            raise ConfigError(path, "must be a list")
        if meta.get("max_items") is not None and len(value) > meta["max_items"]:
            raise ConfigError(path, f"more than {meta['max_items']} items")
        item = get_args(tp)[0]
        if _kind(item) == "scalar":
            items = _scalar_items(item, value, path, meta)
        else:
            items = tuple(
                _parse_value(item, v, f"{path}[{i}]", meta, docs) for i, v in enumerate(value)
            )
        if meta.get("unique_by"):
            _check_unique(items, meta["unique_by"], path)
        if meta.get("item_rule") is not None:
            rule: Rule = meta["item_rule"]
            for i, v in enumerate(items):
                if not evaluate(rule.rule, v, f"{path}[{i}]"):
                    raise ConfigError(f"{path}[{i}]", _message(rule, v))
        return items
    if not isinstance(value, dict):
        raise ConfigError(path, "must be an object")
    vt = get_args(tp)[1]
    return {str(k): _parse_value(vt, v, join(path, str(k)), {}, docs) for k, v in value.items()}


def _scalar_items(
    tp: Any, values: list[Any], path: str, meta: typing.Mapping[str, Any]
) -> tuple[Any, ...]:
    """A list of scalars (the longest lists a spec has: thousands of flags, module and model
    names), each checked without building its path unless it is refused."""
    out = []
    for i, v in enumerate(values):
        try:
            out.append(_scalar(tp, v, path, meta))
        except ConfigError as error:
            raise ConfigError(f"{path}[{i}]", error.message) from None
    return tuple(out)


def _scalar(tp: Any, value: Any, path: str, meta: typing.Mapping[str, Any]) -> Any:
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
    # The length first: it bounds what the pattern is matched against.
    if meta.get("max_length") is not None and len(value) > meta["max_length"]:
        raise ConfigError(path, f"longer than {meta['max_length']} characters")
    if meta.get("pattern") and not _pattern(meta["pattern"]).search(value):
        raise ConfigError(path, f"{value!r} does not match {meta['pattern']}")
    return value


@functools.cache
def _pattern(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def _check_unique(items: tuple[Any, ...], key: str, path: str) -> None:
    """Each item's key (its own value for `.`) once, in one pass, as the API server checks a
    list-type map or set."""
    first: dict[Any, int] = {}
    for i, item in enumerate(items):
        value = item if key == "." else getattr(item, _field_by_json_name(type(item), key))  # type: ignore[arg-type]
        if value in first:
            raise ConfigError(
                f"{path}[{i}]", f"duplicate value {value!r} (also item {first[value]})"
            )
        first[value] = i


@functools.cache
def _field_by_json_name(cls: type[Any], key: str) -> str:
    return next(f.name for f, name, _, _ in _field_table(cls) if name == key)  # type: ignore[arg-type]


T = typing.TypeVar("T")


def parse(cls: type[T], data: Any, path: str = "") -> T:
    """Read `data` into `cls`, applying defaults; unknown fields and bad values are errors.

    The result is a frozen value, so an equal document parses once: the operator parses every
    spec and the gateway config it renders on each reconcile, and the CEL rules alone cost
    milliseconds a document. A new document is parsed from `data` itself (the result keeps
    no reference into it: free-form objects are copied): decoding its memo key back, as this
    once did, cost as much as a fifth of the largest spec's parse.
    """
    try:
        key = (cls, json.dumps(data, sort_keys=True), path)
    except (TypeError, ValueError):  # not a JSON document (a YAML date, say): no memo
        return _parse(cls, data, path)
    parsed = _DOCUMENTS.get(key)
    if parsed is MISSING_ENTRY:
        parsed = _parse(cls, data, path)
        _DOCUMENTS.put(key, parsed)
    return typing.cast(T, parsed)


_DOCUMENTS = Memo(256)
"""The documents parsed last, by their canonical JSON."""


@functools.cache
def _field_table(cls: type[Any]) -> tuple[tuple[dataclasses.Field[Any], str, Any, bool], ...]:
    """Each field with its JSON name, its type and whether it may be null (resolving the
    type hints once per class: `typing.get_type_hints` re-evaluates every annotation)."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f, json_name(f), *_unwrap_optional(hints[f.name])) for f in dataclasses.fields(cls)
    )


@functools.cache
def _default_object(cls: type[Any]) -> Any:
    """An object of all its defaults (frozen: one value serves every parse)."""
    return _parse(cls, {}, "")


@functools.cache
def _field_keys(cls: type[Any]) -> frozenset[str]:
    return frozenset(key for _, key, _, _ in _field_table(cls))  # type: ignore[arg-type]


def _parse(cls: type[T], data: Any, path: str, docs: Docs | None = None) -> T:
    docs = {} if docs is None else docs
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, "must be an object")
    table = _field_table(cls)  # type: ignore[arg-type]
    unknown = sorted(data.keys() - _field_keys(cls))  # type: ignore[arg-type]
    if unknown:
        raise ConfigError(join(path, unknown[0]), "unknown field")
    values = {}
    for f, key, tp, optional in table:
        if data.get(key) is None:
            default = _default_of(f)
            if default is MISSING and not optional:
                raise ConfigError(join(path, key), "required")
            if _kind(tp) == "dataclass" and default is not MISSING and default is not None:
                default = _default_object(tp)
                docs[id(default)] = to_json(default)
            values[f.name] = None if default is MISSING else default
            continue
        values[f.name] = _parse_value(tp, data[key], join(path, key), f.metadata, docs)
    obj = cls(**values)
    document = {
        key: _json_of(values[f.name], docs) for f, key, _, _ in table if values[f.name] is not None
    }
    docs[id(obj)] = document
    rules: tuple[Rule, ...] = getattr(cls, "RULES", ())
    if rules:
        for r in rules:
            if not evaluate(r.rule, document, path):
                where = join(path, (r.field_path or "").lstrip(".")).rstrip(".")
                raise ConfigError(where, _message(r, document))
    return obj


def _json_of(value: Any, docs: Docs) -> Any:
    """`to_json(value)`, reusing the documents of the dataclasses parsed in this parse."""
    if type(value) in (str, int, float, bool):  # not a Duration: it is written as `30s`
        return value
    if isinstance(value, tuple):
        return [_json_of(v, docs) for v in value]
    if id(value) in docs:
        return docs[id(value)]
    return to_json(value)


def _message(rule: Rule, document: Any) -> str:
    """The rule's messageExpression where it evaluates to a string, else its message."""
    from kvfleet_kernel import cel

    if rule.message_expression:
        try:
            text = cel.evaluate(rule.message_expression, document)
        except (cel.CelError, cel.Unsupported):
            text = None
        if isinstance(text, str) and text:
            return text
    return rule.message


# ---- CEL ----------------------------------------------------------------------------------------
# celpy is imported on first use: it costs ~0.15 s at every start of a process that never
# evaluates a rule (a gateway pod, most `kvfleet` commands).
@functools.cache
def _program(rule: str) -> Any:
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def evaluate(rule: str, document: Any, path: str = "") -> bool:
    """A CEL rule with `self` bound to `document`, as the API server evaluates it: compiled
    to Python (`cel`) where the rule's constructs allow, else interpreted by cel-python."""
    from kvfleet_kernel import cel

    try:
        return bool(cel.evaluate(rule, document))
    except cel.CelError as exc:  # e.g. a missing field: the rule does not hold
        raise ConfigError(path, f"rule {rule!r} could not be evaluated: {exc}") from exc
    except cel.Unsupported:
        return interpret(rule, document, path)


def interpret(rule: str, document: Any, path: str = "") -> bool:
    """The rule evaluated by cel-python (what `evaluate` falls back to)."""
    from celpy.adapter import json_to_cel
    from celpy.evaluation import CELEvalError

    try:
        result = _program(rule).evaluate({"self": json_to_cel(document)})
    except CELEvalError as exc:
        raise ConfigError(path, f"rule {rule!r} could not be evaluated: {exc}") from exc
    if isinstance(result, CELEvalError):
        raise ConfigError(path, f"rule {rule!r} could not be evaluated: {result}")
    return bool(result)
