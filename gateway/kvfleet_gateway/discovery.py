"""Kubernetes discovery: engine pods by label selector, kept current by list + watch.

The member set is every pod matching the selector that is Ready, has a pod IP and is not
terminating, as `http://<podIP>:<port>`. A list gives the state and a resourceVersion;
a watch from there streams changes; a 410 Gone (history compacted), a closed stream or the
resync period (the watch's own timeoutSeconds) leads to a fresh list. No polling of pods.
Label equality is re-checked on the client, so a server that ignores the selector cannot
add foreign pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from kvfleet_gateway.config import KubernetesBackends

log = logging.getLogger("kvfleet.gateway.discovery")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MIN_RELIST_S = 1.0


@dataclass(frozen=True)
class KubeAccess:
    server: str
    token: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify: bool = True
    token_file: str | None = None
    """In a pod: the projected service-account token, read again for every request because
    the kubelet rotates it (a token read once at start expires within hours)."""

    def headers(self) -> dict[str, str]:
        token = Path(self.token_file).read_text().strip() if self.token_file else self.token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if not self.verify:
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


def kube_access(kubeconfig: str | None = None) -> KubeAccess:
    """In-cluster service-account credentials, else the kubeconfig ($KUBECONFIG or default)."""
    host, port = (
        os.environ.get("KUBERNETES_SERVICE_HOST"),
        os.environ.get("KUBERNETES_SERVICE_PORT"),
    )
    if kubeconfig is None and host and port and (SA_DIR / "token").exists():
        return KubeAccess(
            f"https://{host}:{port}",
            ca_file=str(SA_DIR / "ca.crt"),
            token_file=str(SA_DIR / "token"),
        )
    from kubernetes import client, config  # the reference loader for kubeconfig files

    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)  # type: ignore[no-untyped-call]
    # The kubernetes package keeps a kubeconfig's token under "BearerToken" (older versions:
    # "authorization"), with its "Bearer " prefix.
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix(
        "authorization"
    )
    token = (header or "").removeprefix("Bearer ").strip() or None
    return KubeAccess(
        cfg.host.rstrip("/"),
        token,
        cfg.ssl_ca_cert,
        cfg.cert_file,
        cfg.key_file,
        bool(cfg.verify_ssl),
    )


def _equalities(selector: str) -> dict[str, str]:
    out = {}
    for term in selector.split(","):
        if "!=" in term or " in " in term or " notin " in term:
            continue  # set-based terms: the server's filtering is trusted
        key, sep, value = term.replace("==", "=").partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def pod_url(pod: dict[str, Any], port: int, wanted: dict[str, str]) -> str | None:
    """Where a ready, matching pod serves; None when it should not get traffic."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    labels = meta.get("labels") or {}
    if any(labels.get(k) != v for k, v in wanted.items()) or meta.get("deletionTimestamp"):
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    ip = status.get("podIP")
    return f"http://{ip}:{port}" if ready and ip else None


class Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


class PodDiscovery:
    def __init__(
        self,
        access: KubeAccess,
        spec: KubernetesBackends,
        on_change: Callable[[set[str]], None],
        resync_s: float = 300.0,
    ) -> None:
        self.access, self.spec, self.on_change = access, spec, on_change
        self.resync_s = resync_s
        self.members: dict[str, str | None] = {}
        """pod name → URL (None: matching but not ready)."""
        self._published: set[str] | None = None
        self._wanted = _equalities(spec.selector)
        self.lists = 0
        self.synced = asyncio.Event()

    @property
    def _pods_url(self) -> str:
        return (
            f"{self.access.server}/api/v1/namespaces/{quote(self.spec.namespace)}/pods"
            f"?labelSelector={quote(self.spec.selector)}"
        )

    def _publish(self) -> None:
        urls = {u for u in self.members.values() if u}
        if urls != self._published:
            self._published = urls
            log.info("discovered %d ready engine pod(s): %s", len(urls), sorted(urls))
            self.on_change(urls)

    async def _list(self, session: aiohttp.ClientSession) -> str:
        async with session.get(self._pods_url, headers=self.access.headers()) as r:
            if r.status != 200:
                raise aiohttp.ClientResponseError(
                    r.request_info, (), status=r.status, message=await r.text()
                )
            body = await r.json()
        port = self.spec.port
        self.members = {
            p["metadata"]["name"]: pod_url(p, port, self._wanted) for p in body.get("items", [])
        }
        self.lists += 1
        self._publish()
        self.synced.set()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, session: aiohttp.ClientSession, rv: str) -> None:
        url = (
            f"{self._pods_url}&watch=true&allowWatchBookmarks=true"
            f"&timeoutSeconds={int(self.resync_s)}"
        )
        if rv:
            url += f"&resourceVersion={quote(rv)}"
        timeout = aiohttp.ClientTimeout(total=None, sock_read=self.resync_s + 30)
        async with session.get(url, timeout=timeout, headers=self.access.headers()) as r:
            if r.status == 410:
                raise Gone()
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
            async for line in r.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise aiohttp.ClientPayloadError(f"watch error: {obj.get('message')}")
                if kind == "BOOKMARK":
                    continue
                name = (obj.get("metadata") or {}).get("name")
                if not name:
                    continue
                if kind == "DELETED":
                    self.members.pop(name, None)
                else:
                    self.members[name] = pod_url(obj, self.spec.port, self._wanted)
                self._publish()

    async def run(self) -> None:
        backoff = 0.5
        connector = aiohttp.TCPConnector(ssl=self.access.ssl_context())
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(connector=connector) as session:
            while True:
                try:
                    started = loop.time()
                    rv = await self._list(session)
                    await self._watch(session, rv)  # returns at timeoutSeconds: resync
                    backoff = 0.5
                    # A watch that keeps ending at once must not turn into a list storm.
                    await asyncio.sleep(max(0.0, MIN_RELIST_S - (loop.time() - started)))
                except Gone:
                    log.info("pod watch expired (410); listing again")
                except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as exc:
                    log.warning("kubernetes API unavailable (%s); retrying in %.1fs", exc, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 30.0)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[PodDiscovery]:
        task = asyncio.create_task(self.run(), name="pod-discovery")
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
