"""The API server's writes: POST, PUT, PATCH and DELETE of one object, with `dryRun=All`
(everything but storing and telling watchers), `fieldManager` and `fieldValidation` (Strict,
Warn — the default — or Ignore, whose unknown fields come back as `Warning` headers)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp.web
import yaml

from kvfleet_localcluster.admission import USER, WRITE, WriteContext
from kvfleet_localcluster.apitypes import ApiError, Kind
from kvfleet_localcluster.store import PatchType, Store

PATCH_TYPES: dict[str, PatchType] = {
    "application/merge-patch+json": "merge",
    "application/json-patch+json": "json",
    "application/strategic-merge-patch+json": "strategic",
    "application/apply-patch+yaml": "apply",
}
FIELD_VALIDATION = ("Strict", "Warn", "Ignore")


def field_manager(raw: aiohttp.web.BaseRequest) -> str:
    """`fieldManager`, else the client's user agent up to its first '/', as the API server
    names a manager nobody named."""
    given = raw.query.get("fieldManager")
    if given is not None:
        if len(given) > 128:
            raise ApiError(422, "Invalid", "fieldManager: Too long: may not be more than 128")
        return given
    return raw.headers.get("User-Agent", "unknown").split("/", 1)[0][:128] or "unknown"


def request_object(request: Any, required: bool = True) -> Any:
    """The parsed body of kmock's request: a JSON object, or None when not `required`."""
    data = request.data
    if data is None and required:
        raise ApiError(400, "BadRequest", "the request body must be a JSON object")
    if data is not None and not isinstance(data, dict):
        raise ApiError(400, "BadRequest", "the request body must be a JSON object")
    return data


async def serve_write(
    store: Store, kind: Kind, request: Any, raw: aiohttp.web.BaseRequest
) -> aiohttp.web.Response:
    q = raw.query
    dry_values = q.getall("dryRun", [])
    if any(v != "All" for v in dry_values):
        raise ApiError(400, "BadRequest", f"unsupported dryRun value(s) {dry_values}: use All")
    validation = q.get("fieldValidation", "Warn")
    if validation not in FIELD_VALIDATION:
        raise ApiError(
            400, "BadRequest", f"fieldValidation must be one of {', '.join(FIELD_VALIDATION)}"
        )
    manager = field_manager(raw)
    body = await raw.read()
    write = WriteContext(validation, user=USER.get(None))
    token = WRITE.set(write)
    try:
        result, status = _dispatch(store, kind, request, raw, body, bool(dry_values), manager)
    finally:
        WRITE.reset(token)
    response = aiohttp.web.json_response(result, status=status)
    for u in write.unknown if validation == "Warn" else ():
        response.headers.add("Warning", f'299 - "unknown field \\"{u}\\""')
    return response


def _dispatch(
    store: Store,
    kind: Kind,
    request: Any,
    raw: aiohttp.web.BaseRequest,
    body: bytes,
    dry: bool,
    manager: str,
) -> tuple[Any, int]:
    ns, name, sub, q = request.namespace, request.name, request.subresource, raw.query
    method = raw.method
    if name is None:
        if method == "POST":
            return store.create(kind, ns, request_object(request), dry, manager), 201
        raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")
    if method == "PUT":
        return store.replace(kind, ns, name, request_object(request), sub, dry, manager), 200
    if method == "PATCH":
        ctype = raw.headers.get("Content-Type", "").split(";")[0].strip()
        patch_type = PATCH_TYPES.get(ctype)
        if patch_type is None:
            raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {ctype!r}")
        try:
            patch = yaml.safe_load(body) if patch_type == "apply" else json.loads(body)
        except ValueError as exc:
            raise ApiError(400, "BadRequest", f"the patch is not valid: {exc}") from None
        force = q.get("force") in ("true", "1")
        if force and patch_type != "apply":
            raise ApiError(400, "BadRequest", "force is only allowed for apply patches")
        return store.patch(kind, ns, name, patch_type, patch, sub, dry, manager, force), 200
    if method == "DELETE":
        options = request_object(request, required=False) or {}
        policy = q.get("propagationPolicy") or options.get("propagationPolicy") or "Background"
        dry = dry or "All" in (options.get("dryRun") or [])
        return store.delete(kind, ns, name, policy, dry), 200
    raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")
