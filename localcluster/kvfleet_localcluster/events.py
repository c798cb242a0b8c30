"""Events the node's own components post (the kubelet's FailedMount, Failed), as a real
kubelet's event recorder posts them: a Warning about the pod, and a repeat of the same reason
and message counted on the one Event (`count`, `lastTimestamp`) instead of a new object."""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kvfleet_localcluster.apitypes import ApiError
from kvfleet_localcluster.kinds import EVENT
from kvfleet_localcluster.store import Store

NODE = "local"
"""The one node's name (`spec.nodeName` of every pod)."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class EventRecorder:
    store: Store
    component: str = "kubelet"
    _counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.store.kinds.setdefault(EVENT.key, EVENT)

    def warning(self, pod: dict[str, Any], reason: str, message: str) -> None:
        """A Warning Event about `pod` (its metadata)."""
        ns, name = pod.get("namespace", "default"), pod.get("name", "")
        digest = hashlib.sha256(f"{pod.get('uid')}/{reason}/{message}".encode()).hexdigest()
        event_name = f"{name}.{digest[:16]}"
        count = self._counts.get(event_name, 0) + 1
        self._counts[event_name] = count
        stamp = _now()
        with contextlib.suppress(ApiError):  # the namespace is going away
            if count > 1:
                patch = {"count": count, "lastTimestamp": stamp}
                self.store.patch(EVENT, ns, event_name, "merge", patch, None)
                return
            self.store.create(
                EVENT,
                ns,
                {
                    "apiVersion": "v1",
                    "kind": "Event",
                    "metadata": {"name": event_name, "namespace": ns},
                    "involvedObject": {
                        "apiVersion": "v1", "kind": "Pod", "namespace": ns, "name": name,
                        "uid": pod.get("uid", ""),
                    },
                    "reason": reason,
                    "message": message,
                    "type": "Warning",
                    "source": {"component": self.component, "host": NODE},
                    "reportingComponent": self.component,
                    "reportingInstance": NODE,
                    "count": 1,
                    "firstTimestamp": stamp,
                    "lastTimestamp": stamp,
                },
            )  # fmt: skip
