"""A small asynchronous client of a Kubernetes API server, for the node agent.

The node agent is a stand-in for the kubelet, and the kubelet talks to the API server as any
client does: REST over HTTPS with a bearer token, list-then-watch with a resource version, and
writes to the `status` subresource. This covers exactly what the agent needs (get, list,
watch, create, patch, delete) and nothing else; errors come back as `ApiError` with the
server's own `Status` message.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp

from kvfleet_localcluster.apitypes import ApiError

Json = dict[str, Any]
PATCH_TYPES = {
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "json": "application/json-patch+json",
}


@dataclass(frozen=True)
class Resource:
    """Where a kind lives in the API: `/api/v1` or `/apis/<group>/<version>`, its plural."""

    group: str
    version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None = None, name: str | None = None, sub: str = "") -> str:
        root = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            root += f"/namespaces/{namespace}"
        root += f"/{self.plural}"
        if name:
            root += f"/{name}"
        if sub:
            root += f"/{sub}"
        return root


PODS = Resource("", "v1", "pods")
NODES = Resource("", "v1", "nodes", namespaced=False)
SERVICES = Resource("", "v1", "services")
EVENTS = Resource("", "v1", "events")
LEASES = Resource("coordination.k8s.io", "v1", "leases")
SECRETS = Resource("", "v1", "secrets")
CONFIGMAPS = Resource("", "v1", "configmaps")
PVCS = Resource("", "v1", "persistentvolumeclaims")
PVS = Resource("", "v1", "persistentvolumes", namespaced=False)
SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts")


class KubeClient:
    """One HTTPS session to the API server; `close()` (or `async with`) releases it."""

    def __init__(
        self,
        url: str,
        ca_pem: bytes,
        user_agent: str,
        token: str | None = None,
        client_cert: tuple[Path, Path] | None = None,
    ) -> None:
        """Log in with a bearer `token`, or a client certificate (cert file, key file)."""
        self.url = url.rstrip("/")
        context = ssl.create_default_context(cadata=ca_pem.decode())
        if client_cert is not None:
            context.load_cert_chain(*client_cert)
        headers = {"User-Agent": user_agent}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        self._session = aiohttp.ClientSession(
            headers=headers, connector=aiohttp.TCPConnector(ssl=context)
        )

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._session.close()

    async def _request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Json:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        async with self._session.request(method, self.url + path, data=data, headers=headers) as r:
            text = await r.text()
            if r.status >= 400:
                raise _error(r.status, text)
            return json.loads(text) if text else {}

    async def get(self, res: Resource, namespace: str | None, name: str, sub: str = "") -> Json:
        return await self._request("GET", res.path(namespace, name, sub))

    async def list(
        self, res: Resource, namespace: str | None = None, params: Mapping[str, str] | None = None
    ) -> Json:
        query = f"?{urlencode(params)}" if params else ""
        return await self._request("GET", res.path(namespace) + query)

    async def create(self, res: Resource, namespace: str | None, obj: Json, sub: str = "") -> Json:
        name = obj.get("metadata", {}).get("name") if sub else None
        return await self._request("POST", res.path(namespace, name, sub), obj)

    async def patch(
        self,
        res: Resource,
        namespace: str | None,
        name: str,
        patch: Any,
        kind: str = "merge",
        sub: str = "",
    ) -> Json:
        path = res.path(namespace, name, sub)
        return await self._request("PATCH", path, patch, PATCH_TYPES[kind])

    async def update(self, res: Resource, namespace: str | None, obj: Json, sub: str = "") -> Json:
        path = res.path(namespace, obj["metadata"]["name"], sub)
        return await self._request("PUT", path, obj)

    async def delete(
        self,
        res: Resource,
        namespace: str | None,
        name: str,
        grace_seconds: int | None = None,
        uid: str | None = None,
    ) -> Json:
        """Delete; `uid`: only the object of that uid (not one created again under its name)."""
        body: Json = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        if uid:
            body["preconditions"] = {"uid": uid}
        return await self._request("DELETE", res.path(namespace, name), body)

    async def token(self, namespace: str, account: str, request: Json) -> str:
        """A ServiceAccount token from the TokenRequest API (bound to a pod, as a kubelet asks)."""
        path = SERVICE_ACCOUNTS.path(namespace, account, "token")
        reply = await self._request("POST", path, request)
        return str(reply["status"]["token"])

    async def watch(
        self,
        res: Resource,
        resource_version: str,
        params: Mapping[str, str] | None = None,
        timeout_s: int = 300,
    ) -> AsyncIterator[tuple[str, Json]]:
        """(type, object) pairs from one watch request, until the server ends it. A `410 Gone`
        (the version is too old) comes as an `ApiError`: list again."""
        query = urlencode(
            {
                "watch": "true",
                "resourceVersion": resource_version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(timeout_s),
                **(params or {}),
            }
        )
        timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_s + 30)
        async with self._session.get(f"{self.url}{res.path()}?{query}", timeout=timeout) as r:
            if r.status >= 400:
                raise _error(r.status, await r.text())
            async for line in r.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    raise ApiError(
                        int(status.get("code", 500)),
                        status.get("reason", ""),
                        status.get("message", ""),
                    )
                yield event["type"], event["object"]


def _error(code: int, text: str) -> ApiError:
    try:
        status = json.loads(text)
    except ValueError:
        return ApiError(code, "Unknown", text.strip()[:500])
    return ApiError(code, status.get("reason", ""), status.get("message", text))
