"""What an API server does with a custom resource's structural schema on every write:
apply `default`s, prune unknown fields, check types, enums, bounds, patterns and `required`,
and evaluate the `x-kubernetes-validations` CEL rules (with cel-python; Kubernetes' CEL
library adds a few extensions this does not have). Errors read like the API server's:
`spec.replicas: Invalid value: "object": replicas and autoscaling are mutually exclusive`.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from typing import Any

import celpy
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError

Json = dict[str, Any]
_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


@functools.cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def apply_defaults(schema: Json, value: Any) -> None:
    """Fill missing properties that have a `default`, depth first (in place)."""
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                apply_defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for item in value.values():
                apply_defaults(extra, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(schema["items"], item)


def _scalar_errors(schema: Json, value: Any, path: str) -> list[str]:
    out = []
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(json.dumps(v) for v in schema["enum"])
        out.append(f"{path}: Unsupported value: {json.dumps(value)}: supported values: {allowed}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{path}: Invalid value: {value}: should be >= {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{path}: Invalid value: {value}: should be <= {schema['maximum']}")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(
                f"{path}: Invalid value: {json.dumps(value)}: should match '{schema['pattern']}'"
            )
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            out.append(f"{path}: Too long: may not be more than {schema['maxLength']} bytes")
    return out


def validate(schema: Json, value: Any, path: str, unknown: list[str] | None = None) -> list[str]:
    """Errors of `value` against `schema`; unknown object fields are pruned (in place) and
    their paths added to `unknown` (for fieldValidation Strict and Warn)."""
    kind = schema.get("type")
    if kind in _TYPES and (
        not isinstance(value, _TYPES[kind]) or (kind != "boolean" and isinstance(value, bool))
    ):
        return [
            f"{path}: Invalid value: {json.dumps(value)}: {path} in body must be of type {kind}"
        ]
    out = _scalar_errors(schema, value, path)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for name in list(value):
            if name in props:
                out += validate(props[name], value[name], f"{path}.{name}", unknown)
            elif isinstance(extra, dict):
                out += validate(extra, value[name], f"{path}.{name}", unknown)
            elif props and not schema.get("x-kubernetes-preserve-unknown-fields"):
                del value[name]  # the API server prunes fields its schema does not know
                if unknown is not None:
                    unknown.append(f"{path}.{name}")
        out += [
            f"{path}.{r}: Required value" for r in schema.get("required") or [] if r not in value
        ]
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            out.append(
                f"{path}: Too many: {len(value)}: must have at most {schema['maxItems']} items"
            )
        for i, item in enumerate(value):
            out += validate(schema["items"], item, f"{path}[{i}]", unknown)
        out += _duplicates(schema, value, path)
    if not out:  # rules see a value whose own fields are valid, as in Kubernetes
        for rule in schema.get("x-kubernetes-validations") or []:
            try:
                result = _program(rule["rule"]).evaluate({"self": json_to_cel(value)})
                holds = not isinstance(result, CELEvalError) and bool(result)
            except CELEvalError:
                holds = False
            if not holds:
                where = path + (rule.get("fieldPath") or "")
                out.append(f'{where}: Invalid value: "{kind}": {_message(rule, value)}')
    return out


def _message(rule: Json, value: Any) -> str:
    """A rule's messageExpression, where it evaluates to a string; else its message."""
    if rule.get("messageExpression"):
        try:
            text = _program(rule["messageExpression"]).evaluate({"self": json_to_cel(value)})
        except CELEvalError:
            text = None
        if isinstance(text, str) and text:
            return str(text)
    return str(rule.get("message") or rule["rule"])


def _duplicates(schema: Json, items: list[Any], path: str) -> list[str]:
    """A list-type set's repeated values, a list-type map's repeated keys: the API server's
    `Duplicate value` errors."""
    kind = schema.get("x-kubernetes-list-type")
    keys = schema.get("x-kubernetes-list-map-keys") or []
    seen: set[str] = set()
    out = []
    for i, item in enumerate(items):
        if kind == "set":
            key = json.dumps(item, sort_keys=True)
        elif kind == "map" and isinstance(item, dict):
            key = json.dumps({k: item.get(k) for k in keys}, sort_keys=True)
        else:
            continue
        if key in seen:
            out.append(f"{path}[{i}]: Duplicate value: {key}")
        seen.add(key)
    return out


_CAUSE_REASONS = {
    "Invalid value": "FieldValueInvalid",
    "Unsupported value": "FieldValueNotSupported",
    "Required value": "FieldValueRequired",
    "Too long": "FieldValueTooLong",
    "Too many": "FieldValueTooMany",
    "Duplicate value": "FieldValueDuplicate",
}


def causes(errors: list[str]) -> list[dict[str, str]]:
    """The `details.causes` of a 422 Status, as a real API server lists them (kubectl edit
    and apply print each cause's field and message): one per error of `validate`."""
    out = []
    for error in errors:
        field, _, message = error.partition(": ")
        kind = message.split(":", 1)[0]
        out.append(
            {"reason": _CAUSE_REASONS.get(kind, "FieldValueInvalid"), "message": message,
             "field": field}
        )  # fmt: skip
    return out
