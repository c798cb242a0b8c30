"""Factories for the objects tests apply, and readers of what comes back."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NS = "ai"


def isvc(name: str = "llama", namespace: str = NS, **spec: Any) -> dict[str, Any]:
    """A minimal InferenceService (llama-3.1-8b on h100, gateway without keys); `spec`
    entries replace the defaults at the top level."""
    base: dict[str, Any] = {
        "model": {
            "name": "llama-3.1-8b",
            "source": {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"},
        },
        "engine": {"gpuType": "h100"},
        "gateway": {"insecureNoAuth": True},
    }
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": copy.deepcopy({**base, **spec}),
    }


def claim(name: str, namespace: str = NS) -> dict[str, Any]:
    """A read-only PersistentVolumeClaim (the local cluster's kubelet gives it a directory)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }


def example(name: str) -> list[dict[str, Any]]:
    """The documents of `examples/<name>`."""
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def condition(body: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    """The condition of that type in an object's status ({} when absent)."""
    for c in ((body or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c  # type: ignore[no-any-return]
    return {}


ENGINE_SELECTOR = "kvfleet.dev/inferenceservice=llama,kvfleet.dev/role=active"
"""What the gateway of InferenceService `llama` selects: its active engine pods."""


def engine_pod(
    name: str, ip: str, ready: bool = True, labels: dict[str, str] | None = None
) -> dict[str, Any]:
    """An engine pod of `llama` as the kubelet reports it (posted whole to a bare API server)."""
    default = {"kvfleet.dev/inferenceservice": "llama", "kvfleet.dev/role": "active"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels or default},
        "spec": {"containers": [{"name": "engine", "image": "kvfleet"}]},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }
