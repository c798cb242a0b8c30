"""Kubernetes' protobuf encoding, read for the kinds `kubectl create ...` sends.

kubectl's typed commands (`create secret`, `create configmap`, `create serviceaccount`,
`create namespace`, `create role`, `create rolebinding`, `create clusterrole[binding]`,
`create token`) send `application/vnd.kubernetes.protobuf` and, unlike its generic paths, do
not fall back to JSON on 415. This decodes those bodies into the JSON objects the rest of the
API server handles: the envelope (`k8s\\0` + runtime.Unknown{typeMeta, raw}), then the object
by a field table per kind (field numbers of k8s.io/api's generated.proto). A kind without a
table stays a 415. Pure functions.
"""

from __future__ import annotations

import base64
from typing import Any

MAGIC = b"k8s\x00"
Json = dict[str, Any]
Schema = dict[int, tuple[str, Any]]
"""field number → (JSON name, type): "s" string, "b" bytes (base64 in JSON), "i" integer,
"?" bool, "{s}" map<string,string>, "{b}" map<string,bytes>, a Schema (message); a type in
a one-element list is repeated."""


class ProtobufError(ValueError):
    pass


OWNER_REFERENCE: Schema = {
    1: ("kind", "s"),
    3: ("name", "s"),
    4: ("uid", "s"),
    5: ("apiVersion", "s"),
    6: ("controller", "?"),
    7: ("blockOwnerDeletion", "?"),
}
OBJECT_META: Schema = {
    1: ("name", "s"),
    2: ("generateName", "s"),
    3: ("namespace", "s"),
    5: ("uid", "s"),
    6: ("resourceVersion", "s"),
    11: ("labels", "{s}"),
    12: ("annotations", "{s}"),
    13: ("ownerReferences", [OWNER_REFERENCE]),
    14: ("finalizers", ["s"]),
}
LOCAL_REF: Schema = {1: ("name", "s")}
POLICY_RULE: Schema = {
    1: ("verbs", ["s"]),
    2: ("apiGroups", ["s"]),
    3: ("resources", ["s"]),
    4: ("resourceNames", ["s"]),
    5: ("nonResourceURLs", ["s"]),
}
SUBJECT: Schema = {1: ("kind", "s"), 2: ("apiGroup", "s"), 3: ("name", "s"), 4: ("namespace", "s")}
ROLE_REF: Schema = {1: ("apiGroup", "s"), 2: ("kind", "s"), 3: ("name", "s")}
BINDING: Schema = {
    1: ("metadata", OBJECT_META),
    2: ("subjects", [SUBJECT]),
    3: ("roleRef", ROLE_REF),
}
ROLE: Schema = {1: ("metadata", OBJECT_META), 2: ("rules", [POLICY_RULE])}
BOUND_OBJECT: Schema = {1: ("kind", "s"), 2: ("apiVersion", "s"), 3: ("name", "s"), 4: ("uid", "s")}
RESOURCE_ATTRIBUTES: Schema = {
    1: ("namespace", "s"),
    2: ("verb", "s"),
    3: ("group", "s"),
    4: ("version", "s"),
    5: ("resource", "s"),
    6: ("subresource", "s"),
    7: ("name", "s"),
}
ACCESS_REVIEW: Schema = {
    1: ("metadata", OBJECT_META),
    2: (
        "spec",
        {
            1: ("resourceAttributes", RESOURCE_ATTRIBUTES),
            2: ("nonResourceAttributes", {1: ("path", "s"), 2: ("verb", "s")}),
        },
    ),
}
KINDS: dict[str, Schema] = {
    "Secret": {
        1: ("metadata", OBJECT_META),
        2: ("data", "{b}"),
        3: ("type", "s"),
        4: ("stringData", "{s}"),
        5: ("immutable", "?"),
    },
    "ConfigMap": {
        1: ("metadata", OBJECT_META),
        2: ("data", "{s}"),
        3: ("binaryData", "{b}"),
        4: ("immutable", "?"),
    },
    "ServiceAccount": {
        1: ("metadata", OBJECT_META),
        3: ("imagePullSecrets", [LOCAL_REF]),
        4: ("automountServiceAccountToken", "?"),
    },
    "Namespace": {1: ("metadata", OBJECT_META), 2: ("spec", {1: ("finalizers", ["s"])})},
    "Role": ROLE,
    "ClusterRole": ROLE,
    "RoleBinding": BINDING,
    "ClusterRoleBinding": BINDING,
    "SelfSubjectAccessReview": ACCESS_REVIEW,
    "SelfSubjectRulesReview": {1: ("metadata", OBJECT_META), 2: ("spec", {1: ("namespace", "s")})},
    "SelfSubjectReview": {1: ("metadata", OBJECT_META)},
    "TokenRequest": {
        1: ("metadata", OBJECT_META),
        2: (
            "spec",
            {
                1: ("audiences", ["s"]),
                3: ("boundObjectRef", BOUND_OBJECT),
                4: ("expirationSeconds", "i"),
            },
        ),
    },
}


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(data):
            raise ProtobufError("truncated varint")
        b = data[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7
        if shift > 63:
            raise ProtobufError("varint too long")


def fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """The (field number, value) pairs of a message: ints for varints, bytes otherwise."""
    out: list[tuple[int, int | bytes]] = []
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
            out.append((number, value))
        elif wire == 2:
            size, i = _varint(data, i)
            if i + size > len(data):
                raise ProtobufError("truncated field")
            out.append((number, data[i : i + size]))
            i += size
        elif wire in (1, 5):  # fixed64 / fixed32: no field we read uses them
            i += 8 if wire == 1 else 4
        else:
            raise ProtobufError(f"unsupported wire type {wire}")
    return out


def _value(kind: Any, raw: int | bytes) -> Any:
    if kind == "i":
        return raw
    if kind == "?":
        return bool(raw)
    if not isinstance(raw, bytes):
        raise ProtobufError("expected a length-delimited field")
    if kind == "s":
        return raw.decode()
    if kind == "b":
        return base64.b64encode(raw).decode()
    if isinstance(kind, dict):
        return message(raw, kind)
    raise ProtobufError(f"unknown field type {kind!r}")


def message(data: bytes, schema: Schema) -> Json:
    out: Json = {}
    for number, raw in fields(data):
        if number not in schema:
            continue  # a field we do not read (status, server-set fields)
        name, kind = schema[number]
        if kind in ("{s}", "{b}"):
            entry = dict(fields(raw if isinstance(raw, bytes) else b""))
            key = _value("s", entry.get(1, b""))
            out.setdefault(name, {})[key] = _value(kind[1], entry.get(2, b""))
        elif isinstance(kind, list):
            out.setdefault(name, []).append(_value(kind[0], raw))
        elif (value := _value(kind, raw)) not in ("", {}):  # Go writes empty fields; JSON omits
            out[name] = value
    return out


def decode(body: bytes) -> Json:
    """A protobuf request body → its JSON object; ProtobufError for what cannot be read."""
    if not body.startswith(MAGIC):
        raise ProtobufError("not a Kubernetes protobuf envelope")
    unknown = {n: v for n, v in fields(body[len(MAGIC) :]) if isinstance(v, bytes)}
    type_meta = dict(fields(unknown.get(1, b"")))
    api_version = _value("s", type_meta.get(1, b""))
    kind = _value("s", type_meta.get(2, b""))
    schema = KINDS.get(kind)
    if schema is None:
        raise ProtobufError(f"{kind or 'this kind'} in protobuf is not supported")
    obj = message(unknown.get(2, b""), schema)
    return {"apiVersion": api_version, "kind": kind, **obj}
