"""The operator's Kubernetes access: the `kubernetes` client's transport and auth, used
generically (one code path for every kind the operator owns) and counted.

Calls are synchronous (the `kubernetes` package is); the handlers run a reconcile in a
worker thread. `Kube.calls` counts requests by verb so tests can assert what a reconcile
costs and that a steady state writes nothing.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import kubernetes.client
from kubernetes.client.exceptions import ApiException

from kvfleet_kernel.schema import Json
from kvfleet_operator.cache import WatchCache
from kvfleet_operator.gateway_spec import IG_KIND, IG_PLURAL
from kvfleet_operator.spec import GROUP, KIND, PLURAL, VERSION


@dataclass(frozen=True)
class Resource:
    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        parts = [base]
        if self.namespaced and namespace:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        if name:
            parts.append(name)
        if sub:
            parts.append(sub)
        return "/".join(parts)


_KNOWN = [
    Resource(f"{GROUP}/{VERSION}", KIND, PLURAL),
    Resource(f"{GROUP}/{VERSION}", IG_KIND, IG_PLURAL),
    Resource("v1", "Pod", "pods"),
    Resource("v1", "Service", "services"),
    Resource("v1", "ConfigMap", "configmaps"),
    Resource("v1", "Secret", "secrets"),
    Resource("v1", "ServiceAccount", "serviceaccounts"),
    Resource("v1", "PersistentVolumeClaim", "persistentvolumeclaims"),
    Resource("v1", "Event", "events"),
    Resource("apps/v1", "Deployment", "deployments"),
    Resource("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    Resource("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    Resource("rbac.authorization.k8s.io/v1", "Role", "roles"),
    Resource("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    Resource("monitoring.coreos.com/v1", "PodMonitor", "podmonitors"),
    Resource("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets"),
]
RESOURCES = {(r.api_version, r.kind): r for r in _KNOWN}


def resource_by_plural(plural: str) -> Resource:
    return next(r for r in _KNOWN if r.plural == plural)


ISVC = RESOURCES[(f"{GROUP}/{VERSION}", KIND)]
IGW = RESOURCES[(f"{GROUP}/{VERSION}", IG_KIND)]
POD = RESOURCES[("v1", "Pod")]
DEPLOYMENT = RESOURCES[("apps/v1", "Deployment")]
LEADER_WORKER_SET = RESOURCES[("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")]
SECRET = RESOURCES[("v1", "Secret")]
EVENT = RESOURCES[("v1", "Event")]
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
PRUNABLE = [
    RESOURCES[k]
    for k in [
        ("apps/v1", "Deployment"),
        ("v1", "Service"),
        ("v1", "ConfigMap"),
        ("v1", "ServiceAccount"),
        ("rbac.authorization.k8s.io/v1", "Role"),
        ("rbac.authorization.k8s.io/v1", "RoleBinding"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
        ("monitoring.coreos.com/v1", "PodMonitor"),
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    ]
]
"""Children deleted when a new spec stops rendering them (never pods, PVCs or the CR)."""


def resource_of(obj: Json) -> Resource:
    try:
        return RESOURCES[(obj["apiVersion"], obj["kind"])]
    except KeyError:
        raise ValueError(f"the operator does not manage {obj.get('apiVersion')}/{obj.get('kind')}")  # noqa: B904


FIELD_MANAGER = "kvfleet-operator"
"""How the operator's writes are named in `metadata.managedFields`."""


def api_status(exc: ApiException) -> Json:
    """The Status object an API server sent with an error response ({} when it sent none)."""
    try:
        status = json.loads(exc.body or "{}")
    except ValueError:
        return {}
    return status if isinstance(status, dict) else {}


class Kube:
    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        field_manager: str = FIELD_MANAGER,
        cache: WatchCache | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.api = api
        self.timeout_s = timeout_s
        """Every request's bound (connect and read): one hung connection must not stall the
        reconcile worker forever."""
        self.field_manager = field_manager
        self.cache = cache
        """Reads of primed kinds come from here (the watches); None: every read is a GET."""
        self.calls: collections.Counter[str] = collections.Counter()

    @property
    def writes(self) -> int:
        return sum(n for verb, n in self.calls.items() if verb in WRITES)

    def _send(
        self,
        method: str,
        path: str,
        body: Any,
        content_type: str,
        query: dict[str, str] | None,
        timeout: float | tuple[float, float],
    ) -> Any:
        """One request through the client's transport and auth; the response (raises
        ApiException for a status outside 2xx, with the server's body)."""
        if query:
            path = f"{path}?{urlencode(query)}"
        headers = {"Accept": "application/json", "Content-Type": content_type}
        params = self.api.param_serialize(
            method=method,
            resource_path=path,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*params, _request_timeout=timeout)
        if not 200 <= response.status < 300:
            response.read()  # type: ignore[no-untyped-call]
            raise ApiException(status=response.status, reason=response.reason, http_resp=response)
        return response

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        query: dict[str, str] | None = None,
    ) -> Json:
        self.calls[method] += 1
        response = self._send(method, path, body, content_type, query, self.timeout_s)
        data: bytes = response.read()
        parsed: Json = json.loads(data) if data else {}
        return parsed

    def open_stream(self, path: str, query: dict[str, str], read_timeout_s: float) -> Any:
        """A streaming GET (a watch): the open urllib3 response, to read line by line and to
        `shutdown()` from another thread. Counted as a WATCH, not a read."""
        self.calls["WATCH"] += 1
        timeout = (self.timeout_s, read_timeout_s)
        return self._send("GET", path, None, "application/json", query, timeout).response

    def _cached(self, res: Resource) -> WatchCache | None:
        return self.cache if self.cache is not None and self.cache.primed(res.plural) else None

    def _observed(self, res: Resource, obj: Json) -> Json:
        if self.cache is not None and obj.get("metadata"):
            self.cache.wrote(res.plural, obj)
        return obj

    def get(
        self, res: Resource, namespace: str | None, name: str, fresh: bool = False
    ) -> Json | None:
        """The object (None: not found); `fresh` asks the API server, not the cache (whose
        watches see only labelled objects: a foreign one it learnt of can be stale)."""
        if cache := self._cached(res):
            if not fresh:
                return cache.get(res.plural, namespace, name)
            # A LIST by name: the operator's RBAC grants what its informers need (list,
            # watch), not get.
            found = self.list(res, namespace, fields=f"metadata.name={name}")
            return found[0] if found else None
        try:
            return self.request("GET", res.path(namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self,
        res: Resource,
        namespace: str | None,
        selector: str | None = None,
        fields: str | None = None,
    ) -> list[Json]:
        """`selector` is a label selector; `fields` a field selector (always asked of the API
        server: the cache keeps labels, not field indexes)."""
        if fields is None and (cache := self._cached(res)):
            items = cache.list(res.plural, namespace, selector)
        else:
            query = {"labelSelector": selector} if selector else {}
            if fields:
                query["fieldSelector"] = fields
            reply = self.request("GET", res.path(namespace), query=query or None)
            items = reply.get("items") or []
        # A real API server leaves kind and apiVersion out of a list's items (a watch event's
        # object has them): every item says what it is, however it was read.
        for item in items:
            item.setdefault("apiVersion", res.api_version)
            item.setdefault("kind", res.kind)
        return items

    def create(self, obj: Json) -> Json:
        """POST (Events; children are applied)."""
        res = resource_of(obj)
        created = self.request(
            "POST",
            res.path(obj["metadata"].get("namespace")),
            obj,
            query={"fieldManager": self.field_manager},
        )
        return self._observed(res, created)

    def apply(self, obj: Json) -> Json:
        """Server-side apply of the whole desired object, taking over conflicting fields
        (`force`, the controller idiom): the API server creates it when missing, removes
        fields this manager applied before and no longer sends, leaves fields other
        managers own alone, and changes nothing (no new resourceVersion) when nothing
        differs."""
        res = resource_of(obj)
        meta = obj["metadata"]
        applied = self.request(
            "PATCH",
            res.path(meta.get("namespace"), meta["name"]),
            obj,
            "application/apply-patch+yaml",  # JSON is YAML
            query={"fieldManager": self.field_manager, "force": "true"},
        )
        return self._observed(res, applied)

    def replace_managed_fields(self, live: Json, managed: Sequence[Json]) -> Json:
        """Rewrite `live`'s managedFields (a JSON patch guarded by its resourceVersion: a
        concurrent write makes it a 409 and the next reconcile reads again)."""
        res = resource_of(live)
        meta = live["metadata"]
        ops = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]},
            {"op": "replace", "path": "/metadata/managedFields", "value": list(managed)},
        ]
        patched = self.request(
            "PATCH",
            res.path(meta.get("namespace"), meta["name"]),
            ops,
            "application/json-patch+json",
            query={"fieldManager": self.field_manager},
        )
        return self._observed(res, patched)

    def patch(
        self, res: Resource, namespace: str | None, name: str, patch: Json, sub: str | None = None
    ) -> Json:
        try:
            patched = self.request(
                "PATCH",
                res.path(namespace, name, sub),
                patch,
                "application/merge-patch+json",
                query={"fieldManager": self.field_manager},
            )
        except ApiException as exc:
            if exc.status == 404 and self.cache is not None:
                self.cache.forget(res.plural, namespace or "", name)  # gone: the cache was late
            raise
        return self._observed(res, patched)

    def delete(self, res: Resource, namespace: str | None, name: str) -> None:
        if self.cache is not None:
            self.cache.forget(res.plural, namespace or "", name)
        try:
            self.request(
                "DELETE",
                res.path(namespace, name),
                {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"},
            )
        except ApiException as exc:
            if exc.status != 404:  # already gone is what we wanted
                raise

    def served(self, api_version: str) -> bool:
        """Whether the API server serves a group/version (e.g. the Prometheus Operator's)."""
        path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        try:
            self.request("GET", path)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True
