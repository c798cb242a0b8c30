"""Discovery and OpenAPI documents the way kubectl expects them.

kmock renders discovery well enough for the `kubernetes` client; kubectl is stricter:
the core group's version must read "v1", and subresources (`x/status`, `x/scale`) must not
repeat their parent's short names and categories (kubectl otherwise warns that `kis` is
ambiguous). `/openapi/v3` lists every served kind with the operations kubectl looks for, and the
schemas of the CRDs applied, so `kubectl explain kis.spec` reads their descriptions. The
PATCH/POST operations declare `fieldValidation`, so kubectl leaves field validation to the
server, which checks custom resources against their CRD (`validation.py`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

Json = dict[str, Any]
SUBRESOURCE_VERBS = {"status": ["get", "patch", "update"], "scale": ["get", "patch", "update"]}


def fix_resource_list(data: Json) -> Json:
    """An APIResourceList as a real API server renders it."""
    if data.get("groupVersion") == "/v1":
        data["groupVersion"] = "v1"
    for res in data.get("resources") or []:
        if "/" not in res.get("name", ""):
            continue
        sub = res["name"].split("/", 1)[1]
        for key in ("shortNames", "categories", "singularName"):
            res.pop(key, None)
        res["singularName"] = ""
        res["verbs"] = SUBRESOURCE_VERBS.get(sub, ["get"])
        if sub == "scale":
            res |= {"group": "autoscaling", "version": "v1", "kind": "Scale"}
    return data


def _schema_name(group: str, version: str, kind: str) -> str:
    """Kubernetes names OpenAPI schemas by the reversed group: dev.kvfleet.v1alpha1.Kind."""
    return ".".join([*reversed(group.split(".")), version, kind])


@dataclass(frozen=True)
class ServedKind:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool


def _operations(k: ServedKind, ref: str) -> Json:
    """Path items kubectl reads: the GVK of each operation, and that PATCH/POST accept
    `fieldValidation` (so kubectl leaves field validation to the server)."""
    gvk = {"group": k.group, "version": k.version, "kind": k.kind}
    body = {"content": {"application/json": {"schema": {"$ref": ref}}}}
    param = [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}]

    def op(verb: str, params: bool) -> Json:
        return {
            "operationId": f"{verb}{k.kind}",
            "x-kubernetes-action": verb,
            "x-kubernetes-group-version-kind": gvk,
            "responses": {"200": {"description": "OK", **body}},
            **({"parameters": param} if params else {}),
        }

    base = "/api/v1" if not k.group else f"/apis/{k.group}/{k.version}"
    collection = (
        f"{base}/namespaces/{{namespace}}/{k.plural}" if k.namespaced else f"{base}/{k.plural}"
    )
    return {
        collection: {"get": op("list", False), "post": op("post", True)},
        f"{collection}/{{name}}": {
            "get": op("get", False),
            "put": op("put", True),
            "patch": op("patch", True),
            "delete": op("delete", False),
        },
    }


def _group_doc(kinds: list[ServedKind], crds: list[Json], group: str, version: str) -> Json:
    schemas: Json = {}
    for crd in crds:
        spec = crd.get("spec") or {}
        if spec.get("group") != group:
            continue
        kind = (spec.get("names") or {}).get("kind", "")
        for v in spec.get("versions") or []:
            if v.get("name") == version:
                schema = dict(((v.get("schema") or {}).get("openAPIV3Schema")) or {})
                schemas[_schema_name(group, version, kind)] = schema
    paths: Json = {}
    for k in kinds:
        if (k.group, k.version) != (group, version):
            continue
        name = _schema_name(group, version, k.kind)
        schema = schemas.setdefault(
            name, {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        )
        schema["x-kubernetes-group-version-kind"] = [
            {"group": group, "version": version, "kind": k.kind}
        ]
        paths |= _operations(k, f"#/components/schemas/{name}")
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.31.0-kvfleet-local"},
        "paths": paths,
        "components": {"schemas": schemas},
    }


def _gv_path(group: str, version: str) -> str:
    return f"api/{version}" if not group else f"apis/{group}/{version}"


def openapi_v3(kinds: list[ServedKind], crds: list[Json], path: str) -> Json | None:
    """The document at `path`: `/openapi/v3` (the index) or `/openapi/v3/<api|apis/...>`."""
    rest = path.strip("/").removeprefix("openapi/v3").strip("/")
    versions = sorted({(k.group, k.version) for k in kinds})
    if not rest:
        paths = {}
        for group, version in versions:
            doc = _group_doc(kinds, crds, group, version)
            digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
            gv = _gv_path(group, version)
            paths[gv] = {"serverRelativeURL": f"/openapi/v3/{gv}?hash={digest}"}
        return {"paths": paths}
    for group, version in versions:
        if rest == _gv_path(group, version):
            return _group_doc(kinds, crds, group, version)
    return None
