"""Events the node agent posts about its pods (FailedMount, Failed, Unhealthy, Killing), as a
kubelet's event recorder does: a repeat of the same reason and message is counted on one Event
(`count`, `lastTimestamp`) instead of a new object. Posting never blocks the pod's life: each
Event is sent by a task of its own, and a failure is only logged."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kvfleet_localcluster.apitypes import ApiError
from kvfleet_localcluster.kubeapi import EVENTS, KubeClient

log = logging.getLogger("kvfleet.node.events")
Json = dict[str, Any]


@dataclass
class NodeEvents:
    client: KubeClient
    node: str
    component: str = "kubelet"
    _counts: dict[str, int] = field(default_factory=dict)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def post(self, pod: Json, reason: str, message: str, kind: str = "Warning") -> None:
        """An Event about `pod` (its metadata), sent in the background."""
        task = asyncio.create_task(self._send(pod, reason, message, kind))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, pod: Json, reason: str, message: str, kind: str) -> None:
        ns, name = pod.get("namespace", "default"), pod.get("name", "")
        digest = hashlib.sha256(f"{pod.get('uid')}/{reason}/{message}".encode()).hexdigest()
        event_name = f"{name}.{digest[:16]}"
        count = self._counts.get(event_name, 0) + 1
        self._counts[event_name] = count
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        try:
            if count > 1:
                patch = {"count": count, "lastTimestamp": stamp}
                await self.client.patch(EVENTS, ns, event_name, patch)
                return
            await self.client.create(
                EVENTS, ns, self._event(pod, event_name, reason, message, kind, stamp)
            )
        except ApiError as exc:  # the namespace is going away, or the pod is
            log.info("event %s on %s/%s not posted: %s", reason, ns, name, exc.message)

    def _event(
        self, pod: Json, event_name: str, reason: str, message: str, kind: str, stamp: str
    ) -> Json:
        ns = pod.get("namespace", "default")
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": event_name, "namespace": ns},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": ns,
                "name": pod.get("name", ""),
                "uid": pod.get("uid", ""),
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": self.component, "host": self.node},
            "reportingComponent": self.component,
            "reportingInstance": self.node,
            "count": 1,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
        }
