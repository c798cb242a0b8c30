"""kmock's KubernetesEmulator with the API-server semantics clients rely on.

kmock keeps doing what it does well — the HTTP server, request parsing, API discovery
(`/api`, `/apis`), request history and test reactions. Object requests are served here from
a `Store` with real semantics: 201 on create, 409 on conflicts, 422 on failed patches, 404;
PUT, merge / JSON / strategic-merge patches and single-manager server-side apply; status and
scale subresources; label and field selectors on list and watch; watches that resume from a
resourceVersion (410 when too old) and end at timeoutSeconds; generateName; namespaces;
ownerReference garbage collection; CRDs that become servable resources when created, with
their schemas applied to every write (`validation.py`); discovery, OpenAPI v3 and
server-side tables shaped for kubectl (`openapi.py`, `tables.py`).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import yaml

from kvfleet_localcluster import access, protobuf
from kvfleet_localcluster.auth import (
    PUBLIC_PATHS,
    RBAC_GROUP,
    Attributes,
    Authenticator,
    User,
    authorize,
    escalations,
    forbidden_message,
    request_attributes,
)
from kvfleet_localcluster.logs import LogSource, serve_logs
from kvfleet_localcluster.openapi import ServedKind, fix_resource_list, openapi_v3
from kvfleet_localcluster.store import ApiError, Gone, Kind, PatchType, Store
from kvfleet_localcluster.tables import to_table
from kvfleet_localcluster.validation import apply_defaults, validate

PATCH_TYPES: dict[str, PatchType] = {
    "application/merge-patch+json": "merge",
    "application/json-patch+json": "json",
    "application/strategic-merge-patch+json": "strategic",
    "application/apply-patch+yaml": "apply",
}
CRD_GROUP, CRD_PLURAL = "apiextensions.k8s.io", "customresourcedefinitions"


def _wants_table(raw: aiohttp.web.BaseRequest) -> bool:
    """kubectl get asks for `application/json;as=Table;g=meta.k8s.io;v=v1`."""
    return "as=Table" in raw.headers.get("Accept", "")


INITIAL_EVENTS_END = "k8s.io/initial-events-end"
HEALTH_PATHS = ("/healthz", "/livez", "/readyz")
FIELD_VALIDATION = ("Strict", "Warn", "Ignore")


@dataclass
class _WriteContext:
    """What the admission of the write being served needs from its request."""

    validation: str = "Warn"
    unknown: list[str] = field(default_factory=list)
    user: User | None = None
    """Who writes (None: the cluster's own controllers)."""


_WRITE: contextvars.ContextVar[_WriteContext] = contextvars.ContextVar("write")
_USER: contextvars.ContextVar[User | None] = contextvars.ContextVar("user")


@dataclass(frozen=True)
class AuditRecord:
    """One authorized request: who did what (what `kubectl auth can-i` would be asked)."""

    user: str
    verb: str
    group: str
    resource: str
    subresource: str
    namespace: str
    name: str
    user_agent: str


def _status(err: ApiError) -> aiohttp.web.Response:
    return aiohttp.web.json_response(err.status(), status=err.code)


def _field_manager(raw: aiohttp.web.BaseRequest) -> str:
    """`fieldManager`, else the client's user agent up to its first '/', as the API server
    names a manager nobody named."""
    given = raw.query.get("fieldManager")
    if given is not None:
        if len(given) > 128:
            raise ApiError(422, "Invalid", "fieldManager: Too long: may not be more than 128")
        return given
    return raw.headers.get("User-Agent", "unknown").split("/", 1)[0][:128] or "unknown"


_DISCOVERY = re.compile(r"^/(api/v1|apis/[^/]+/[^/]+)/?$")
_NAMESPACES = re.compile(r"^/api/v1/namespaces(?:/([^/]+))?(?:/(status|finalize))?/?$")


@dataclass(frozen=True)
class _Req:
    """The parts of kmock's parsed request that `_serve` reads."""

    namespace: str | None
    name: str | None
    subresource: str | None
    data: Any


class ClusterAPI(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.store = Store()
        self.store.listeners.append(self._on_event)
        self.store.admission.append(self._admit_custom_resource)
        self.store.admission.append(self._admit_pod)
        self.store.admission.append(self._admit_rbac)
        self.validate_custom_resources = True
        """Apply CRD schemas (defaults, pruning, types, CEL) on writes, as a real API server
        does; False stands in for one that lets anything through (an old, pre-CEL server)."""
        self._schemas: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._changed = asyncio.Event()
        self._closed = False
        self.request_log: list[tuple[str, str, str]] = []
        """(method, path, User-Agent) of every request: what a client cost."""
        self.authn = Authenticator(
            lambda ns, name: self.store.exists("", "serviceaccounts", ns, name)
        )
        self.audit: list[AuditRecord] = []
        """Every authorized request, with its user: what a client actually used."""
        self.logs: LogSource | None = None
        """The node's container logs (`pods/log`); None: no kubelet runs."""

    # ---- resources ------------------------------------------------------------------------
    def load_resources(self) -> None:
        """kmock's bundled built-in kinds, minus the metrics API (no metrics-server runs
        here, and kubectl would otherwise resolve `pods` to metrics.k8s.io PodMetrics)."""
        self.resources.load_bundled()
        for res in [r for r in self.resources if r.group == "metrics.k8s.io"]:
            del self.resources[res]

    def _admit_custom_resource(
        self, kind: Kind, obj: dict[str, Any], subresource: str | None
    ) -> None:
        schema = self._schemas.get((kind.group, kind.version, kind.plural))
        if schema is None or not self.validate_custom_resources:
            return
        errors: list[str] = []
        write = _WRITE.get(_WriteContext())
        unknown: list[str] = []
        # Main writes check the spec (status is carried over), status writes the status.
        for part in ("status",) if subresource == "status" else ("spec",):
            sub = (schema.get("properties") or {}).get(part)
            if sub is not None and part in obj:
                apply_defaults(sub, obj[part])
                errors += validate(sub, obj[part], part, unknown)
        name = (obj.get("metadata") or {}).get("name", "")
        if unknown and write.validation == "Strict":
            fields = ", ".join(f'unknown field "{u}"' for u in unknown)
            raise ApiError(
                400,
                "BadRequest",
                f'{kind.kind} in version "{kind.version}" cannot be handled as a {kind.kind}: '
                f"strict decoding error: {fields}",
            )
        write.unknown += unknown
        if errors:
            raise ApiError(
                422,
                "Invalid",
                f'{kind.kind}.{kind.group} "{name}" is invalid: ' + ", ".join(errors),
            )

    def ensure_default_service_account(self, namespace: str) -> None:
        """The ServiceAccount controller's job: every namespace has a `default` account."""
        if not self.store.exists("", "serviceaccounts", namespace, "default"):
            kind = self.kind("", "v1", "serviceaccounts")
            self.store.create(kind, namespace, {"metadata": {"name": "default"}})

    def _admit_pod(self, kind: Kind, obj: dict[str, Any], subresource: str | None) -> None:
        """The ServiceAccount admission plugin: a new pod runs as an account that exists."""
        meta = obj.get("metadata") or {}
        if kind.key != ("", "pods") or subresource or "uid" in meta:
            return
        ns = meta.get("namespace", "default")
        account = (obj.get("spec") or {}).get("serviceAccountName") or "default"
        if account == "default":
            self.ensure_default_service_account(ns)
        elif not self.store.exists("", "serviceaccounts", ns, account):
            raise ApiError(
                403,
                "Forbidden",
                f'pods "{meta.get("name") or meta.get("generateName", "")}" is forbidden: '
                f'error looking up service account {ns}/{account}: serviceaccount "{account}" '
                "not found",
            )

    def _admit_rbac(self, kind: Kind, obj: dict[str, Any], subresource: str | None) -> None:
        """No one grants, by a role or a binding, more than they hold (unless they may
        `escalate` / `bind`), as RBAC's escalation prevention refuses."""
        write = _WRITE.get(_WriteContext())
        user = write.user
        if user is None or kind.group != RBAC_GROUP or subresource:
            return
        meta = obj.get("metadata") or {}
        ns = meta.get("namespace", "") if kind.namespaced else ""
        policy = access.policy(self.store)
        if kind.plural in ("roles", "clusterroles"):
            granted, verb, target = obj.get("rules") or [], "escalate", kind.plural
            role_name = meta.get("name", "")
        elif kind.plural in ("rolebindings", "clusterrolebindings"):
            ref = obj.get("roleRef") or {}
            role_name = ref.get("name", "")
            if ref.get("kind") == "ClusterRole":
                role = self.store.peek(RBAC_GROUP, "clusterroles")
                found = [r for r in role if r["metadata"]["name"] == role_name]
                target = "clusterroles"
            else:
                found = [r for r in self.store.peek(RBAC_GROUP, "roles", ns)]
                found = [r for r in found if r["metadata"]["name"] == role_name]
                target = "roles"
            granted, verb = [rule for r in found for rule in r.get("rules") or []], "bind"
            if not found:
                granted = [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}]
        else:
            return
        allowed, _ = authorize(
            user, Attributes(verb, "", True, RBAC_GROUP, "", target, "", ns, role_name), policy
        )
        missing = [] if allowed else escalations(user, policy, granted, ns)
        if missing:
            raise ApiError(
                403,
                "Forbidden",
                f'{kind.plural}.{RBAC_GROUP} "{meta.get("name", "")}" is forbidden: user '
                f'"{user.name}" is attempting to grant RBAC permissions not currently held: '
                + "; ".join(missing[:10]),
            )

    def served_kinds(self) -> list[ServedKind]:
        out = []
        for res in self.resources:
            info = self.resources[res]
            if info.kind and res.plural and "/" not in res.plural:
                out.append(
                    ServedKind(
                        res.group or "",
                        res.version or "",
                        res.plural,
                        info.kind,
                        bool(info.namespaced),
                    )
                )
        return out

    def close_watches(self) -> None:
        """End every open watch (clients then see the stream close, as on a server restart)."""
        self._closed = True
        self._changed.set()

    def _on_event(self, kind: Kind, event: str, obj: dict[str, Any]) -> None:
        if kind.key == (CRD_GROUP, CRD_PLURAL) and event in ("ADDED", "MODIFIED"):
            self.register_crd(obj)
        if kind.key == ("", "namespaces") and event == "ADDED":
            self.ensure_default_service_account(obj["metadata"]["name"])
        self._changed.set()
        self._changed = asyncio.Event()

    def kind(self, group: str, version: str, plural: str) -> Kind:
        res = kmock.resource(group, version, plural)
        # (`.get` would widen the type to kmock's ResourceDict union)
        info = self.resources[res] if res in self.resources else None  # noqa: SIM401
        if info is None or info.kind is None:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({plural})"
            )
        spec = self.store.kinds.get((group, plural))
        if spec is None:
            subresources = frozenset(info.subresources or ())
            if (group, plural) in (
                ("apps", "deployments"),
                ("apps", "statefulsets"),
                ("apps", "replicasets"),
            ):
                spec = Kind(
                    group,
                    version,
                    plural,
                    info.kind,
                    bool(info.namespaced),
                    subresources | {"status", "scale"},
                    selector_path="spec.selector",
                )
            else:
                spec = Kind(group, version, plural, info.kind, bool(info.namespaced), subresources)
            self.store.kinds[(group, plural)] = spec
        return spec

    def register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        group, plural = spec.get("group"), names.get("plural")
        if not group or not plural:
            return
        namespaced = spec.get("scope", "Namespaced") == "Namespaced"
        for version in spec.get("versions") or []:
            schema = (version.get("schema") or {}).get("openAPIV3Schema")
            if schema:
                self._schemas[(group, version["name"], plural)] = schema
            subs = version.get("subresources") or {}
            scale = subs.get("scale") or {}
            self.resources[kmock.resource(group, version["name"], plural)] = kmock.ResourceInfo(
                kind=names.get("kind"),
                singular=names.get("singular"),
                namespaced=namespaced,
                verbs={"list", "watch", "get", "create", "update", "patch", "delete"},
                shortnames=set(names.get("shortNames") or ()),
                categories=set(names.get("categories") or ()),
                subresources=set(subs),
            )
            self.store.kinds[(group, plural)] = Kind(
                group,
                version["name"],
                plural,
                names.get("kind", ""),
                namespaced,
                frozenset(subs),
                scale.get("specReplicasPath", ".spec.replicas"),
                scale.get("statusReplicasPath", ".status.replicas"),
                scale.get("labelSelectorPath"),
            )

    def load_crds(self, directory: Path) -> int:
        """Apply every CRD found in a directory of YAML files (the repository's `crds/`)."""
        kind = self.kind(CRD_GROUP, "v1", CRD_PLURAL)
        count = 0
        for path in sorted(directory.glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                    self.store.create(kind, None, doc)
                    count += 1
        return count

    # ---- HTTP -----------------------------------------------------------------------------
    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        agent = raw.headers.get("User-Agent", "")
        self.request_log.append((raw.method, raw.path, agent))
        if raw.path in HEALTH_PATHS:  # public, as the system:public-info-viewer role has it
            return aiohttp.web.Response(text="ok")
        user = self.authn.authenticate(raw.headers.get("Authorization"))
        if user is None and raw.path not in PUBLIC_PATHS:
            return _status(ApiError(401, "Unauthorized", "Unauthorized"))
        attrs = request_attributes(raw.method, raw.path, raw.query)
        ctype = raw.headers.get("Content-Type", "")
        if raw.method in ("POST", "PUT", "PATCH") and "protobuf" in ctype:
            try:
                obj = protobuf.decode(await raw.read())
            except protobuf.ProtobufError as exc:
                # 415 makes client-go's generic paths (apply, get) fall back to JSON.
                return _status(ApiError(415, "UnsupportedMediaType", f"{ctype}: {exc}"))
            # From here on the request is the JSON it encodes (aiohttp keeps the body it read
            # there; kmock's parser and ours read it back).
            raw._read_bytes = json.dumps(obj).encode()
        if user is not None:
            allowed, _ = authorize(user, attrs, access.policy(self.store))
            if not allowed:
                return _status(ApiError(403, "Forbidden", forbidden_message(user, attrs)))
            self.audit.append(
                AuditRecord(
                    user.name,
                    attrs.verb,
                    attrs.group,
                    attrs.resource,
                    attrs.subresource,
                    attrs.namespace,
                    attrs.name,
                    agent,
                )
            )
            special = await self._special(user, attrs, raw)
            if special is not None:
                return special
        _USER.set(user)  # this request's task: its writes' admission knows the writer
        # kmock reads /api/v1/namespaces[/name] as a namespace prefix with no resource and
        # fails; namespaces are objects like any other here.
        if raw.path.startswith("/openapi/"):
            crds, _ = self.store.list_objects(self.kind(CRD_GROUP, "v1", CRD_PLURAL), None)
            doc = openapi_v3(self.served_kinds(), crds, raw.path)
            if doc is None:
                return aiohttp.web.json_response(
                    ApiError(
                        404, "NotFound", "the server could not find the requested resource"
                    ).status(),
                    status=404,
                )
            return aiohttp.web.json_response(doc)
        m = _NAMESPACES.match(raw.path)
        if m is None:
            response = await super().__call__(raw)
            if _DISCOVERY.match(raw.path) and isinstance(response, aiohttp.web.Response):
                return self._fix_discovery(response)
            return response
        body = await raw.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        request = _Req(namespace=None, name=m.group(1), subresource=m.group(2), data=data)
        try:
            return await self._serve(self.kind("", "v1", "namespaces"), request, raw)
        except ApiError as err:
            return _status(err)

    async def _special(
        self, user: User, attrs: Attributes, raw: aiohttp.web.BaseRequest
    ) -> aiohttp.web.StreamResponse | None:
        """Endpoints that are not stored objects: reviews, token requests, logs."""
        if not attrs.resource_request:
            return None
        try:
            if (attrs.group, attrs.resource) in access.REVIEWS and attrs.verb == "create":
                body = await self._read_json(raw)
                return self._json(access.review(user, attrs, body, self.store), 201)
            if (attrs.resource, attrs.subresource) == ("serviceaccounts", "token"):
                if attrs.verb != "create":
                    raise ApiError(405, "MethodNotAllowed", "token requests are POSTs")
                body = await self._read_json(raw)
                token = access.token_request(
                    self.authn, self.store, attrs.namespace, attrs.name, body
                )
                return self._json(token, 201)
            if (attrs.resource, attrs.subresource) == ("pods", "log") and attrs.verb == "get":
                pod = self.store.get(self.kind("", "v1", "pods"), attrs.namespace, attrs.name)
                if self.logs is None:
                    raise ApiError(400, "BadRequest", "no kubelet runs in this cluster")
                return await serve_logs(raw, pod, self.logs, lambda: self._closed)
        except ApiError as err:
            return _status(err)
        return None

    @staticmethod
    async def _read_json(raw: aiohttp.web.BaseRequest) -> Any:
        body = await raw.read()
        try:
            return json.loads(body) if body else None
        except ValueError:
            raise ApiError(400, "BadRequest", "the request body is not valid JSON") from None

    @staticmethod
    def _fix_discovery(response: aiohttp.web.Response) -> aiohttp.web.Response:
        body = response.body
        try:
            data = json.loads(body) if isinstance(body, bytes) else None
        except ValueError:
            return response
        if isinstance(data, dict) and data.get("kind") == "APIResourceList":
            return aiohttp.web.json_response(fix_resource_list(data), status=response.status)
        return response

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        resource = request.resource
        if resource is None or resource.plural is None:
            return await super()._handle(request)  # discovery and anything not an object
        raw: aiohttp.web.BaseRequest = request._raw_request
        try:
            kind = self.kind(resource.group or "", resource.version or "", resource.plural)
            return await self._serve(kind, request, raw)
        except ApiError as err:
            return _status(err)

    async def _serve(
        self, kind: Kind, request: Any, raw: aiohttp.web.BaseRequest
    ) -> aiohttp.web.StreamResponse:
        ns, name, sub = request.namespace, request.name, request.subresource
        q = raw.query
        method = raw.method
        if method == "GET" and q.get("watch") in ("true", "1"):
            return await self._watch(kind, ns, name, raw)
        if method in ("POST", "PUT", "PATCH", "DELETE"):
            return await self._write(kind, request, raw)
        if name is None:
            if method == "GET":
                items, rv = self.store.list_objects(
                    kind, ns, q.get("labelSelector"), q.get("fieldSelector")
                )
                if _wants_table(raw):
                    return self._json(self._table(kind, items, rv))
                return self._json(
                    {
                        "apiVersion": kind.api_version,
                        "kind": f"{kind.kind}List",
                        "metadata": {"resourceVersion": rv},
                        "items": items,
                    }
                )
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")
        if method == "GET":
            if sub == "scale":
                return self._json(self.store.get_scale(kind, ns, name))
            obj = self.store.get(kind, ns, name)
            if _wants_table(raw) and not sub:
                return self._json(self._table(kind, [obj], obj["metadata"]["resourceVersion"]))
            return self._json(obj)
        raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")

    async def _write(
        self, kind: Kind, request: Any, raw: aiohttp.web.BaseRequest
    ) -> aiohttp.web.StreamResponse:
        """POST, PUT, PATCH, DELETE: with `dryRun=All` (everything but storing and telling
        watchers), `fieldManager` and `fieldValidation` (Strict / Warn, the default / Ignore)."""
        q = raw.query
        dry_values = q.getall("dryRun", [])
        if any(v != "All" for v in dry_values):
            raise ApiError(400, "BadRequest", f"unsupported dryRun value(s) {dry_values}: use All")
        validation = q.get("fieldValidation", "Warn")
        if validation not in FIELD_VALIDATION:
            raise ApiError(
                400, "BadRequest", f"fieldValidation must be one of {', '.join(FIELD_VALIDATION)}"
            )
        manager = _field_manager(raw)
        body = await raw.read()
        write = _WriteContext(validation, user=_USER.get(None))
        token = _WRITE.set(write)
        try:
            result, status = self._dispatch_write(
                kind, request, raw, body, bool(dry_values), manager
            )
        finally:
            _WRITE.reset(token)
        response = self._json(result, status)
        for u in write.unknown if validation == "Warn" else ():
            response.headers.add("Warning", f'299 - "unknown field \\"{u}\\""')
        return response

    def _dispatch_write(
        self,
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
                return self.store.create(kind, ns, self._body(raw, request), dry, manager), 201
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")
        if method == "PUT":
            obj = self._body(raw, request)
            return self.store.replace(kind, ns, name, obj, sub, dry, manager), 200
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
            result = self.store.patch(kind, ns, name, patch_type, patch, sub, dry, manager, force)
            return result, 200
        if method == "DELETE":
            options = self._body(raw, request, required=False) or {}
            policy = (
                q.get("propagationPolicy") or options.get("propagationPolicy") or ("Background")
            )
            dry = dry or "All" in (options.get("dryRun") or [])
            return self.store.delete(kind, ns, name, policy, dry), 200
        raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")

    def _table(self, kind: Kind, items: list[dict[str, Any]], rv: str) -> dict[str, Any]:
        columns = None
        for crd in self.store.list_objects(self.kind(CRD_GROUP, "v1", CRD_PLURAL), None)[0]:
            spec = crd.get("spec") or {}
            if (spec.get("group"), (spec.get("names") or {}).get("plural")) == kind.key:
                for v in spec.get("versions") or []:
                    if v.get("name") == kind.version:
                        columns = v.get("additionalPrinterColumns")
        return to_table(kind.kind, items, columns, rv)

    @staticmethod
    def _body(raw: aiohttp.web.BaseRequest, request: Any, required: bool = True) -> Any:
        data = request.data
        if data is None and required:
            raise ApiError(400, "BadRequest", "the request body must be a JSON object")
        if data is not None and not isinstance(data, dict):
            raise ApiError(400, "BadRequest", "the request body must be a JSON object")
        return data

    @staticmethod
    def _json(obj: Any, status: int = 200) -> aiohttp.web.Response:
        return aiohttp.web.json_response(obj, status=status)

    @staticmethod
    def _bookmark(kind: Kind, rv: int) -> dict[str, Any]:
        return {
            "apiVersion": kind.api_version,
            "kind": kind.kind,
            "metadata": {"resourceVersion": str(rv)},
        }

    async def _watch(
        self, kind: Kind, ns: str | None, name: str | None, raw: aiohttp.web.BaseRequest
    ) -> aiohttp.web.StreamResponse:
        q = raw.query
        fields = q.get("fieldSelector")
        if name:  # GET .../pods/x?watch=true: a watch on one object
            fields = ",".join(x for x in (fields, f"metadata.name={name}") if x)
        labels = q.get("labelSelector")
        timeout = float(q.get("timeoutSeconds") or 1800)
        bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
        # Watch-list (kubectl ≥ 1.35 lists this way): the current objects as ADDED events,
        # then a bookmark annotated initial-events-end, then changes.
        initial = q.get("sendInitialEvents") in ("true", "1")
        resp = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        try:
            since = None if initial else q.get("resourceVersion")
            events, seen = self.store.events_since(kind, ns, since, labels, fields)
        except Gone as gone:
            await resp.prepare(raw)
            await resp.write(
                json.dumps({"type": "ERROR", "object": gone.status()}).encode() + b"\n"
            )
            return resp
        await resp.prepare(raw)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                for event, obj in events:
                    await resp.write(json.dumps({"type": event, "object": obj}).encode() + b"\n")
                    seen = max(seen, int(obj["metadata"]["resourceVersion"]))
                events = []
                if initial:
                    initial = False
                    mark = self._bookmark(kind, seen)
                    mark["metadata"]["annotations"] = {INITIAL_EVENTS_END: "true"}
                    await resp.write(
                        json.dumps({"type": "BOOKMARK", "object": mark}).encode() + b"\n"
                    )
                remaining = deadline - loop.time()
                if remaining <= 0 or self._closed:
                    break
                changed = self._changed
                try:
                    await asyncio.wait_for(changed.wait(), timeout=min(remaining, 60))
                except TimeoutError:
                    if bookmarks:
                        mark = self._bookmark(kind, self.store.rv)
                        await resp.write(
                            json.dumps({"type": "BOOKMARK", "object": mark}).encode() + b"\n"
                        )
                    continue
                if self._closed:
                    break
                events, _ = self.store.events_since(kind, ns, str(seen), labels, fields)
        except (ConnectionResetError, Gone):
            pass
        return resp
