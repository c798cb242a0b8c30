"""What the node agent keeps for the pods it runs: the objects they reference, their tokens,
and their status on its way to the API server.

`PodRunner` (kubelet.py) reads Secrets, ConfigMaps and PVCs synchronously and writes status
synchronously; against a real API server both are network calls. So the agent reads every
object a pod references (and the pod's ServiceAccount token, from the TokenRequest API,
bound to the pod) into a cache before the pod starts and every few seconds after, and status
writes are queued and sent by one task, the latest status per pod winning — as the kubelet's
status manager coalesces them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvfleet_localcluster.apitypes import ApiError
from kvfleet_localcluster.kubeapi import CONFIGMAPS, PODS, PVCS, SECRETS, KubeClient

log = logging.getLogger("kvfleet.node.pods")

TRANSIENT = (aiohttp.ClientError, OSError, TimeoutError)
"""What a request to the API server raises besides an answer (a connection reset or refused,
a timeout): asked again, as a kubelet does, instead of ending the task that asked."""
RETRY_S = 0.5
Json = dict[str, Any]
REFERENCES = {"Secret": SECRETS, "ConfigMap": CONFIGMAPS, "PersistentVolumeClaim": PVCS}
TOKEN_SECONDS = 3600
AUTHORIZER_RETRIES = 20
AUTHORIZER_RETRY_S = 0.25


def references(pod_spec: Json) -> Iterator[tuple[str, str]]:
    """(kind, name) of every Secret, ConfigMap and PVC the pod's volumes and env use."""
    for vol in pod_spec.get("volumes") or []:
        for kind, key, name_key in (
            ("Secret", "secret", "secretName"),
            ("ConfigMap", "configMap", "name"),
            ("PersistentVolumeClaim", "persistentVolumeClaim", "claimName"),
        ):
            if (src := vol.get(key)) is not None:
                yield kind, str(src.get(name_key, ""))
        for source in (vol.get("projected") or {}).get("sources") or []:
            for kind, key in (("Secret", "secret"), ("ConfigMap", "configMap")):
                if (src := source.get(key)) is not None:
                    yield kind, str(src.get("name", ""))
    for container in pod_spec.get("containers") or []:
        for src in container.get("envFrom") or []:
            for kind, key in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
                if (ref := src.get(key)) is not None:
                    yield kind, str(ref.get("name", ""))
        for var in container.get("env") or []:
            source = var.get("valueFrom") or {}
            for kind, key in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
                if (ref := source.get(key)) is not None:
                    yield kind, str(ref.get("name", ""))


@dataclass
class ReferenceCache:
    """The objects the node's pods reference, and their ServiceAccount tokens."""

    client: KubeClient
    objects: dict[tuple[str, str, str], Json | None] = field(default_factory=dict)
    tokens: dict[tuple[str, str], str] = field(default_factory=dict)

    def read(self, ns: str, kind: str, name: str) -> Json | None:
        return self.objects.get((ns, kind, name))

    def token(self, ns: str, account: str) -> str:
        return self.tokens.get((ns, account), "")

    async def refresh(self, meta: Json, spec: Json) -> None:
        ns = meta["namespace"]
        for kind, name in references(spec):
            self.objects[ns, kind, name] = await self._read_reference(kind, ns, name)
        if spec.get("automountServiceAccountToken") is False:
            return
        account = spec.get("serviceAccountName") or "default"
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": TOKEN_SECONDS,
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": meta["name"],
                    "uid": meta.get("uid", ""),
                },
            },
        }
        with contextlib.suppress(ApiError):  # the account is not there yet: retried
            self.tokens[ns, account] = await self.client.token(ns, account, request)

    async def _read_reference(self, kind: str, ns: str, name: str) -> Json | None:
        """The object, or None when it does not exist. The Node authorizer answers 403 until
        its graph has the pod that references the object — learnt from its own watch, a
        moment after the pod reached this node — so a 403 is asked again for a few seconds
        before it counts as missing (which the pod would report as CreateContainerConfigError)."""
        for _ in range(AUTHORIZER_RETRIES):
            try:
                return await self.client.get(REFERENCES[kind], ns, name)
            except ApiError as exc:
                if exc.code == 404:
                    return None
                if exc.code != 403:
                    raise
            await asyncio.sleep(AUTHORIZER_RETRY_S)
        return None

    async def first_refresh(self, meta: Json, spec: Json) -> None:
        """`refresh` before a pod starts, asked again while the API server fails to answer:
        the pod stays Pending meanwhile, as on a kubelet that cannot reach it."""
        while True:
            try:
                return await self.refresh(meta, spec)
            except (ApiError, *TRANSIENT) as exc:
                ns, name = meta["namespace"], meta["name"]
                log.warning("pod %s/%s: references: %r; again", ns, name, exc)
            await asyncio.sleep(RETRY_S)

    async def keep_fresh(self, meta: Json, spec: Json, period_s: float) -> None:
        """Refresh until cancelled: a rotated Secret reaches the pod's files (`PodRunner`)."""
        while True:
            await asyncio.sleep(period_s)
            try:
                await self.refresh(meta, spec)
            except (ApiError, *TRANSIENT) as exc:
                log.info("pod %s/%s: references: %r", meta["namespace"], meta["name"], exc)


@dataclass
class StatusWriter:
    """Pods' status patches, sent by one task; a newer status for a pod replaces a queued one."""

    client: KubeClient
    _queued: dict[tuple[str, str], tuple[str, Json]] = field(default_factory=dict)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def submit(self, ns: str, name: str, uid: str, status: Json) -> None:
        self._queued[ns, name] = (uid, status)
        self._wake.set()

    def forget(self, ns: str, name: str) -> None:
        self._queued.pop((ns, name), None)

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queued:
                (ns, name), (uid, status) = self._queued.popitem()
                # The uid precondition: a status for a pod deleted and created again under its
                # name (a StatefulSet's) must not land on the new one.
                patch = {"metadata": {"uid": uid}, "status": status}
                try:
                    await self.client.patch(PODS, ns, name, patch, "strategic", sub="status")
                except ApiError as exc:
                    if exc.code not in (404, 409):
                        log.warning("pod %s/%s: status: %s", ns, name, exc.message)
                except TRANSIENT as exc:
                    # Sent again unless a newer status came meanwhile; the writer goes on
                    # (it ended here once, and every pod of the node kept its last status).
                    log.warning("pod %s/%s: status: %r; again", ns, name, exc)
                    self._queued.setdefault((ns, name), (uid, status))
                    await asyncio.sleep(RETRY_S)
