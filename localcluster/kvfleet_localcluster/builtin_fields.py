"""Built-in kinds as kube-apiserver decodes and encodes them: unknown fields, found as its
strict decoder finds them, and zero values of `omitempty` fields, left out as its encoder
leaves them out.

A real API server decodes a Deployment into its Go struct; a field the struct does not have
(`imagePullPolicyy`) is dropped, and reported: with `fieldValidation=Strict` (what kubectl
sends by default) the write fails with 400 `strict decoding error: unknown field "..."`, with
`Warn` it succeeds with a `Warning` header per field. The structs' fields are read from the
OpenAPI definitions that `kubernetes-validate` ships for the Kubernetes version this cluster
reports (`CLUSTER_VERSION`): every object with `additionalProperties: false` lists its fields
exactly; maps (`labels`, `limits`) carry a schema for their values instead.

Under every setting the unknown fields are dropped before the object is stored, as decoding
into the structs drops them. The walk is plain dictionary work, microseconds per object, so
every client write of a built-in kind is checked at every depth, as the real decoder does.

Encoding: a field tagged `omitempty` in the Go types is not written when it holds false, 0,
"" (`zero`), an empty list or map (`empty`) or null (`nil`, a pointer): `publishNotReadyAddresses:
false` or `env: []` sent by a client are not in what the server stores and returns, so a
client that compares what it sent with what it reads sees a difference. The rules come from
`data/omitempty-v<version>.json`, generated from kubernetes/api's Go types
(`omitempty_gen.py`; the file names the tag).
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

CLUSTER_VERSION = "1.31.0"
"""The Kubernetes version the local API server reports (`/version`: v1.31.0)."""

_REF_PREFIXES = ("/api/_definitions.json#/$defs/", "#/$defs/")


@functools.cache
def _definitions() -> dict[str, Any]:
    base = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    path = base / f"v{CLUSTER_VERSION}-local-strict" / "_definitions.json"
    defs: dict[str, Any] = json.loads(path.read_text())["$defs"]
    return defs


@functools.cache
def _kinds() -> dict[tuple[str, str, str], str]:
    """(group, version, kind) → the definition of that kind's top-level object."""
    out = {}
    for name, schema in _definitions().items():
        for gvk in schema.get("x-kubernetes-group-version-kind") or ():
            out[(gvk["group"], gvk["version"], gvk["kind"])] = name
    return out


@functools.cache
def _omitempty() -> dict[str, dict[str, str]]:
    path = resources.files("kvfleet_localcluster") / "data" / f"omitempty-v{CLUSTER_VERSION}.json"
    rules: dict[str, dict[str, str]] = json.loads(path.read_text())["definitions"]
    return rules


def _omitted(rule: str | None, value: Any) -> bool:
    if rule == "zero":
        return value is False or value == 0 or value == ""
    if rule == "empty":
        return value == [] or value == {} or value is None
    return rule == "nil" and value is None


def drop_omitted(group: str, version: str, kind: str, obj: dict[str, Any]) -> None:
    """Remove what the server's encoder would not write: zero values of omitempty fields."""
    name = _kinds().get((group, version, kind))
    if name is not None:
        _encode(name, obj)


def _definition_name(schema: dict[str, Any]) -> str | None:
    ref = schema.get("$ref")
    if isinstance(ref, str):
        for prefix in _REF_PREFIXES:
            if ref.startswith(prefix):
                return ref[len(prefix) :]
    return None


def _encode(name: str, value: dict[str, Any]) -> None:
    schema = _resolve(_definitions()[name])
    rules = _omitempty().get(name, {})
    props = schema.get("properties") or {}
    for key in [k for k, v in value.items() if _omitted(rules.get(k), v)]:
        del value[key]
    for key, sub in value.items():
        _encode_value(props.get(key), sub)


def _encode_value(schema: dict[str, Any] | None, value: Any) -> None:
    if schema is None:
        return
    name = _definition_name(schema)
    if name is not None and isinstance(value, dict):
        _encode(name, value)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _encode_value(schema["items"], item)
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for item in value.values():
            _encode_value(schema["additionalProperties"], item)


def knows(group: str, version: str, kind: str) -> bool:
    """Whether `kind` is a built-in kind of the cluster's version."""
    return (group, version, kind) in _kinds()


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    while isinstance(ref, str):
        for prefix in _REF_PREFIXES:
            if ref.startswith(prefix):
                schema = _definitions()[ref[len(prefix) :]]
                break
        else:
            return {}  # a reference outside the definitions: nothing to check against
        ref = schema.get("$ref")
    return schema


def drop_unknown_fields(group: str, version: str, kind: str, obj: dict[str, Any]) -> list[str]:
    """Remove from `obj` the fields the kind's structs do not have, as decoding into them
    does, and return their paths in the form the strict decoder reports them
    (`spec.template.spec.containers[0].imagePullPolicyy`)."""
    name = _kinds().get((group, version, kind))
    if name is None:
        return []
    found: list[str] = []
    _walk(_definitions()[name], obj, "", found)
    return found


def _walk(schema: dict[str, Any], value: Any, path: str, found: list[str]) -> None:
    schema = _resolve(schema)
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        unknown = []
        for key, sub in value.items():
            where = f"{path}.{key}" if path else str(key)
            if props is not None and key in props:
                _walk(props[key], sub, where, found)
            elif isinstance(extra, dict):
                _walk(extra, sub, where, found)  # a map: every value has this schema
            elif props is not None or extra is False:
                found.append(where)
                unknown.append(key)
        for key in unknown:
            del value[key]
    elif isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for i, sub in enumerate(value):
                _walk(items, sub, f"{path}[{i}]", found)
