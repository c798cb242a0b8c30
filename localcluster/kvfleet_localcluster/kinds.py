"""The built-in kinds the local cluster's controllers act on, and what they share."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvfleet_localcluster.apitypes import Kind

POD = Kind("", "v1", "pods", "Pod", True, frozenset({"status"}))
DEPLOYMENT = Kind(
    "apps",
    "v1",
    "deployments",
    "Deployment",
    True,
    frozenset({"status", "scale"}),
    selector_path="spec.selector",
)
CONFIG_KINDS = {
    "ConfigMap": Kind("", "v1", "configmaps", "ConfigMap", True, frozenset()),
    "Secret": Kind("", "v1", "secrets", "Secret", True, frozenset()),
    "PersistentVolumeClaim": Kind(
        "", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, frozenset({"status"})
    ),
}
STATEFULSET = Kind(
    "apps",
    "v1",
    "statefulsets",
    "StatefulSet",
    True,
    frozenset({"status", "scale"}),
    selector_path="spec.selector",
)
SERVICE = Kind("", "v1", "services", "Service", True, frozenset({"status"}))
EVENT = Kind("", "v1", "events", "Event", True, frozenset())


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def is_ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """A Service's (equality-based) selector matches these labels."""
    return all(labels.get(k) == v for k, v in selector.items())
