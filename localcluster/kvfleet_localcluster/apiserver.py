"""kmock's KubernetesEmulator with the API-server semantics clients rely on.

kmock keeps doing what it does well — the HTTP server, request parsing, API discovery
(`/api`, `/apis`), request history and test reactions. Object requests are served here from
a `Store` with real semantics: 201 on create, 409 on conflicts, 422 on failed patches, 404;
PUT, merge / JSON / strategic-merge patches and single-manager server-side apply; status and
scale subresources; label and field selectors on list and watch; watches that resume from a
resourceVersion (410 when too old) and end at timeoutSeconds; generateName; namespaces;
ownerReference garbage collection; CRDs that become servable resources when created
(`crd_serving.py`), with their schemas applied to every write (`validation.py`, `writes.py`);
discovery, OpenAPI v3 and server-side tables shaped for kubectl (`openapi.py`, `tables.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import yaml

from kvfleet_localcluster import access, portforward, protobuf
from kvfleet_localcluster.admission import USER, Admission
from kvfleet_localcluster.apitypes import ApiError, Kind
from kvfleet_localcluster.auth import (
    PUBLIC_PATHS,
    Attributes,
    Authenticator,
    User,
    authorize,
    forbidden_message,
    impersonated,
    impersonation_checks,
    request_attributes,
)
from kvfleet_localcluster.crd_serving import (
    CRD_GROUP,
    CRD_PLURAL,
    established_status,
    is_established,
    printer_columns,
    served_versions,
)
from kvfleet_localcluster.logs import LogSource, serve_logs
from kvfleet_localcluster.metrics import ApiServerMetrics
from kvfleet_localcluster.openapi import ServedKind, fix_resource_list, openapi_v3
from kvfleet_localcluster.statefulsets import default_statefulset
from kvfleet_localcluster.store import Store
from kvfleet_localcluster.tables import to_table
from kvfleet_localcluster.watch import serve_watch
from kvfleet_localcluster.writes import serve_write


def _wants_table(raw: aiohttp.web.BaseRequest) -> bool:
    """kubectl get asks for `application/json;as=Table;g=meta.k8s.io;v=v1`."""
    return "as=Table" in raw.headers.get("Accept", "")


HEALTH_PATHS = ("/healthz", "/livez", "/readyz")


@dataclass(frozen=True)
class AuditRecord:
    """One request RBAC decided: who did what (what `kubectl auth can-i` would be asked)."""

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
        self._schemas: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.admission = Admission(
            self.store, self._schemas, self.kind, lambda: self.validate_custom_resources
        )
        self.store.admission += [
            self.admission.custom_resource,
            self.admission.builtin_kind,
            self.admission.pod,
            self.admission.rbac,
            default_statefulset,
            self.admission.defaults,
            self.admission.encode_builtin,  # last: what the encoder writes of the result
        ]
        self.validate_custom_resources = True
        """Apply CRD schemas (defaults, pruning, types, CEL) on writes, as a real API server
        does; False stands in for one that lets anything through (an old, pre-CEL server)."""
        self._changed = asyncio.Event()
        self._closed = False
        self.request_log: list[tuple[str, str, str]] = []
        """(method, path, User-Agent) of every request: what a client cost."""
        self.authn = Authenticator(
            lambda ns, name: self.store.exists("", "serviceaccounts", ns, name)
        )
        self.audit: list[AuditRecord] = []
        """Every authorized request, with its user: what a client actually used."""
        self.denied: list[AuditRecord] = []
        """Every request RBAC refused (403), with its user."""
        self.metrics = ApiServerMetrics()
        self.logs: LogSource | None = None
        """The node's container logs (`pods/log`); None: no kubelet runs."""

    # ---- resources ------------------------------------------------------------------------
    def load_resources(self) -> None:
        """kmock's bundled built-in kinds, minus the metrics API (no metrics-server runs
        here, and kubectl would otherwise resolve `pods` to metrics.k8s.io PodMetrics)."""
        self.resources.load_bundled()
        for res in [r for r in self.resources if r.group == "metrics.k8s.io"]:
            del self.resources[res]

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

    @property
    def changed(self) -> asyncio.Event:
        return self._changed

    @property
    def closed(self) -> bool:
        return self._closed

    def close_watches(self) -> None:
        """End every open watch (clients then see the stream close, as on a server restart)."""
        self._closed = True
        self._changed.set()

    def _on_event(self, kind: Kind, event: str, obj: dict[str, Any]) -> None:
        if kind.key == (CRD_GROUP, CRD_PLURAL) and event in ("ADDED", "MODIFIED"):
            self.register_crd(obj)
            if not is_established(obj):  # after this write's listeners, as its own write
                asyncio.get_running_loop().call_soon(self._establish, kind, obj)
        if kind.key == ("", "namespaces") and event == "ADDED":
            self.admission.ensure_default_service_account(obj["metadata"]["name"])
        self._changed.set()
        self._changed = asyncio.Event()

    def _absent(self, attrs: Attributes) -> bool:
        """Whether the object a resource request names does not exist (yet)."""
        if not attrs.resource_request or not attrs.name or attrs.subresource:
            return False
        try:
            kind = self.kind(attrs.group, attrs.version, attrs.resource)
            self.store.get(kind, attrs.namespace or None, attrs.name)
        except ApiError:
            return True
        return False

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
        for served in served_versions(crd):
            if served.schema:
                self._schemas[(served.kind.group, served.kind.version, served.kind.plural)] = (
                    served.schema
                )
            self.resources[served.resource] = served.info
            self.store.kinds[served.kind.key] = served.kind

    def _establish(self, kind: Kind, crd: dict[str, Any]) -> None:
        status = established_status(crd)
        with contextlib.suppress(ApiError):  # deleted meanwhile
            self.store.patch(
                kind, None, crd["metadata"]["name"], "merge", {"status": status}, "status"
            )

    def load_crds(self, directory: Path) -> int:
        """Apply every CRD found in a directory of YAML files (the repository's `crds/`)."""
        docs = [
            doc
            for path in sorted(directory.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text())
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition"
        ]
        return self.apply_crds(docs)

    def apply_crds(self, docs: list[dict[str, Any]]) -> int:
        """Create these CRDs at start (before any client connects)."""
        kind = self.kind(CRD_GROUP, "v1", CRD_PLURAL)
        for doc in docs:
            self.store.create(kind, None, doc)
        return len(docs)

    # ---- HTTP -----------------------------------------------------------------------------
    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        started = time.perf_counter()
        user = self.authn.authenticate(raw.headers.get("Authorization"))
        attrs = request_attributes(raw.method, raw.path, raw.query)
        response = await self._respond(raw, user, attrs)
        streaming = attrs.verb == "watch" or raw.query.get("follow") in ("true", "1")
        self.metrics.observe(user, attrs, response.status, time.perf_counter() - started, streaming)
        return response

    async def _respond(
        self, raw: aiohttp.web.BaseRequest, user: User | None, attrs: Attributes
    ) -> aiohttp.web.StreamResponse:
        agent = raw.headers.get("User-Agent", "")
        self.request_log.append((raw.method, raw.path, agent))
        if raw.path in HEALTH_PATHS:  # public, as the system:public-info-viewer role has it
            return aiohttp.web.Response(text="ok")
        if user is None and raw.path not in PUBLIC_PATHS:
            return _status(ApiError(401, "Unauthorized", "Unauthorized"))
        if user is not None and "Impersonate-User" in raw.headers:
            as_user = raw.headers["Impersonate-User"]
            as_groups = tuple(raw.headers.getall("Impersonate-Group", []))
            for check in impersonation_checks(as_user, as_groups):
                if not authorize(user, check, access.policy(self.store))[0]:
                    return _status(ApiError(403, "Forbidden", forbidden_message(user, check)))
            user = impersonated(as_user, as_groups)
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
            checks = [attrs]
            if attrs.verb == "patch" and "apply-patch" in ctype and self._absent(attrs):
                # An apply that creates is also authorized as a create (kube-apiserver's
                # patch handler): `patch` alone cannot make objects.
                checks.append(dataclasses.replace(attrs, verb="create"))
            for check in checks:
                allowed, _ = authorize(user, check, access.policy(self.store))
                record = AuditRecord(
                    user.name,
                    check.verb,
                    check.group,
                    check.resource,
                    check.subresource,
                    check.namespace,
                    check.name,
                    agent,
                )
                if not allowed:
                    self.denied.append(record)
                    return _status(ApiError(403, "Forbidden", forbidden_message(user, check)))
                self.audit.append(record)
            special = await self._special(user, attrs, raw)
            if special is not None:
                return special
        USER.set(user)  # this request's task: its writes' admission knows the writer
        if raw.path == "/metrics":
            return aiohttp.web.Response(
                body=self.metrics.exposition(), content_type="text/plain", charset="utf-8"
            )
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

    async def _port_forward(
        self, raw: aiohttp.web.BaseRequest, pod: dict[str, Any]
    ) -> aiohttp.web.StreamResponse:
        status = pod.get("status") or {}
        if status.get("phase") != "Running" or not status.get("podIP"):
            raise ApiError(
                400, "BadRequest", f"pod {pod['metadata']['name']} is not running: "
                f"{status.get('phase', 'Pending')}",
            )  # fmt: skip
        offered = raw.headers.get("Sec-WebSocket-Protocol", "")
        if raw.headers.get("Upgrade", "").lower() != "websocket" or (
            portforward.TUNNEL_PROTOCOL not in offered
        ):
            raise ApiError(
                400, "BadRequest", "Upgrade request required: this API server forwards ports "
                f"over a WebSocket with subprotocol {portforward.TUNNEL_PROTOCOL} (kubectl 1.31+)",
            )  # fmt: skip
        return await portforward.serve(raw, str(status["podIP"]))

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
            if (attrs.resource, attrs.subresource) == ("pods", "portforward"):
                pod = self.store.get(self.kind("", "v1", "pods"), attrs.namespace, attrs.name)
                return await self._port_forward(raw, pod)
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

    async def _serve_server_version(self, request: Any) -> Any:
        """The Kubernetes version whose behaviour and schemas this server follows (kubectl's
        version skew checks and Helm's `kubeVersion` constraints read it)."""
        return {
            "major": "1",
            "minor": "31",
            "gitVersion": "v1.31.0+kvfleet-local",
            "gitTreeState": "clean",
            "goVersion": "python",
            "compiler": "kvfleet",
            "platform": "linux/amd64",
        }

    async def _serve(
        self, kind: Kind, request: Any, raw: aiohttp.web.BaseRequest
    ) -> aiohttp.web.StreamResponse:
        ns, name, sub = request.namespace, request.name, request.subresource
        q = raw.query
        method = raw.method
        if method == "GET" and q.get("watch") in ("true", "1"):
            return await serve_watch(self, kind, ns, name, raw)
        if method in ("POST", "PUT", "PATCH", "DELETE"):
            return await serve_write(self.store, kind, request, raw)
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

    def _table(self, kind: Kind, items: list[dict[str, Any]], rv: str) -> dict[str, Any]:
        crds, _ = self.store.list_objects(self.kind(CRD_GROUP, "v1", CRD_PLURAL), None)
        return to_table(kind.kind, items, printer_columns(crds, kind), rv)

    @staticmethod
    def _json(obj: Any, status: int = 200) -> aiohttp.web.Response:
        return aiohttp.web.json_response(obj, status=status)
