"""The LeaderWorkerSet controller on the local control plane, installed from its release files.

Its webhooks are not optional: the Pod mutating webhook labels each group's pods with their
group and worker index, and the controller creates the worker StatefulSets from those labels;
the LeaderWorkerSet webhooks default and validate the spec. So the controller runs with its
webhook server on a loopback port, serving a certificate from the cluster CA, and the
release's webhook configurations are registered with a URL in place of the in-cluster
Service (the API server calls webhooks by URL as readily as through a Service). What is
left out is its in-cluster certificate rotation (it writes a Secret in `lws-system` and
patches the webhook configurations' CA bundles): `internalCertManagement.enable: false`.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import yaml

from kvfleet_localcluster.controlplane_build import Binaries

Json = dict[str, Any]
NAME_PREFIX = "lws-"
"""As the release's kustomization (config/default) names its cluster-scoped objects."""
USER = "kvfleet:lws-controller"
"""The controller's user; the release's ClusterRole is bound to it."""


def _docs(path: Path) -> list[Json]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _json_patch(doc: Json, ops: list[Json]) -> Json:
    """The kustomize patches the release ships: `replace` of one list item or field."""
    out = copy.deepcopy(doc)
    for op in ops:
        if op["op"] != "replace":
            raise ValueError(f"unsupported patch operation {op['op']!r}")
        *parents, last = op["path"].strip("/").split("/")
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(last) if isinstance(node, list) else last] = op["value"]
    return out


def webhook_configurations(release: Path, url: str, ca_pem: bytes) -> list[Json]:
    """The release's webhook configurations, patched as its kustomization does, calling `url`."""
    webhook_dir = release / "config" / "webhook"
    patches = {
        "MutatingWebhookConfiguration": yaml.safe_load(
            (webhook_dir / "mutating-patch.yaml").read_text()
        ),
        "ValidatingWebhookConfiguration": yaml.safe_load(
            (webhook_dir / "validating-patch.yaml").read_text()
        ),
    }
    out = []
    for doc in _docs(webhook_dir / "manifests.yaml"):
        doc = _json_patch(doc, patches.get(doc["kind"], []))
        doc["metadata"]["name"] = NAME_PREFIX + doc["metadata"]["name"]
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {
                "url": f"{url}{path}",
                "caBundle": base64.b64encode(ca_pem).decode(),
            }
        out.append(doc)
    return out


def crds(binaries: Binaries) -> list[Json]:
    bases = binaries.lws_dir / "config" / "crd" / "bases"
    return [doc for path in sorted(bases.glob("*.yaml")) for doc in _docs(path)]


def rbac(binaries: Binaries) -> list[Json]:
    """The release's manager ClusterRole, bound to USER."""
    (role,) = _docs(binaries.lws_dir / "config" / "rbac" / "role.yaml")
    role["metadata"]["name"] = NAME_PREFIX + role["metadata"]["name"]
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": role["metadata"]["name"]},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": role["metadata"]["name"],
        },
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}],
    }
    return [role, binding]


def configuration(webhook_port: int, health_port: int, cert_dir: Path) -> str:
    """The controller's config file (config.lws.x-k8s.io/v1alpha1 Configuration)."""
    return yaml.safe_dump(
        {
            "apiVersion": "config.lws.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        }
    )
