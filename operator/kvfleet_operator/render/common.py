"""Names, labels and metadata every child of an InferenceService shares (the labels the
README's "How it works" lists)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field
from typing import Protocol

from kvfleet_kernel.schema import Json
from kvfleet_operator.gateway_spec import KVFLEET_IMAGE
from kvfleet_operator.spec import GROUP, KIND, VERSION, InferenceServiceSpec

ENGINE, GATEWAY = "engine", "gateway"
PREFILL = "prefill"
"""Disaggregated services: the prefill pool's component (ENGINE is then the decode pool)."""
ENGINE_PORT, GATEWAY_PORT = 30000, 8080
KV_EVENTS_PORT, KV_REPLAY_PORT = 5557, 5558
"""Where engines publish KV events (prefixIndex: events) and answer replay requests."""
GATEWAY_METRICS_PORT = 9090
"""The gateway's /metrics: apart from the API, reachable by scrapers only."""
ISVC_LABEL = "kvfleet.dev/inferenceservice"
ROLE_LABEL = "kvfleet.dev/role"
IG_LABEL = "kvfleet.dev/inference-gateway"
"""On an InferenceGateway's children: the gateway's name (as ISVC_LABEL on a service's)."""
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
"""LeaderWorkerSet's label of a group's pod: "0" on the leader, 1.. on the workers."""


def is_group_worker(labels: dict[str, str]) -> bool:
    """A multi-node replica's worker pod (not its leader, not a one-node replica)."""
    return labels.get(WORKER_INDEX_LABEL, "0") != "0"


GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
"""LeaderWorkerSet's label of a group's pods: the group's index (scale-down removes the
highest first)."""
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kvfleet"}


def selector_of(isvc: str, component: str) -> dict[str, str]:
    """The labels that select an InferenceService's engine or gateway pods."""
    return {ISVC_LABEL: isvc, COMPONENT_LABEL: component}


def shared_gateway_selector(gateway: str) -> dict[str, str]:
    """The labels that select an InferenceGateway's pods."""
    return {IG_LABEL: gateway, COMPONENT_LABEL: GATEWAY}


def selector_string(isvc: str, component: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_of(isvc, component).items())


ENGINE_KEY_KEY = "key"
"""The key in the `<isvc>-engine-key` Secret that holds the engines' API key."""
ENGINE_KEY_ANNOTATION = "kvfleet.dev/engine-key-sha256"
"""On engine and gateway pod templates: a new key rolls both, so they never disagree."""


def new_engine_key() -> str:
    """A fresh engines' API key: 256 random bits, URL-safe (no spaces, no quotes)."""
    return secrets.token_urlsafe(32)


DEFAULT_OPERATOR_NAMESPACE = "kvfleet-system"
"""The operator's namespace when it is not told (`--operator-namespace`, $OPERATOR_NAMESPACE:
the downward API in the shipped manifests)."""


class GatewayOwnerLike(Protocol):
    """What the gateway's renderers need of whoever owns a gateway: an InferenceService
    (its own gateway) or an InferenceGateway (one shared by many services)."""

    @property
    def name(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def operator_namespace(self) -> str: ...
    @property
    def uid(self) -> str: ...
    @property
    def gateway_image(self) -> str: ...
    @property
    def gateway_name(self) -> str: ...
    @property
    def gateway_service(self) -> str: ...
    def metadata(self, name: str, component: str, **extra: Json) -> Json: ...
    def labels(self, component: str) -> dict[str, str]: ...
    def selector(self, component: str) -> dict[str, str]: ...


@dataclass(frozen=True)
class Owner:
    """The InferenceService the children belong to, as the renderers need it."""

    name: str
    namespace: str
    uid: str
    spec: InferenceServiceSpec
    generation: int = 1
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE
    """Where the operator runs: its pods may read the engines' and gateway's /metrics."""
    gateway_image: str = KVFLEET_IMAGE
    """The gateway's image when `spec.gateway.image` is unset: the operator's own."""
    engine_key: str = field(default_factory=new_engine_key, repr=False)
    """The engines' API key (SGLang's --api-key), which only their gateway presents: the
    operator passes the one its Secret already holds; a new Owner gets a fresh one."""

    @property
    def engine_key_secret(self) -> str:
        """The Secret holding the engines' key. Kept with the gateway disabled too: turning
        the gateway off or on must not restart engines (minutes of model load); whatever
        fronts them then reads the key from this Secret."""
        return f"{self.name}-engine-key"

    def engine_key_annotations(self) -> dict[str, str]:
        digest = hashlib.sha256(self.engine_key.encode()).hexdigest()[:16]
        return {ENGINE_KEY_ANNOTATION: digest}

    @property
    def engine_name(self) -> str:
        return f"{self.name}-engine"

    @property
    def prefill_name(self) -> str:
        return f"{self.name}-prefill"

    @property
    def multi_node(self) -> bool:
        """Each replica is a LeaderWorkerSet group of `nodesPerReplica` pods."""
        return self.spec.engine.nodes_per_replica > 1

    @property
    def engine_kind(self) -> str:
        """The engine workload's kind: a Deployment, or a LeaderWorkerSet (multi-node)."""
        return "LeaderWorkerSet" if self.multi_node else "Deployment"

    def replica_selector(self) -> dict[str, str]:
        """The pods that are replicas: every engine pod, or only group leaders (multi-node:
        workers serve no HTTP, and a group counts once)."""
        leaders = {WORKER_INDEX_LABEL: "0"} if self.multi_node else {}
        return {**self.selector(ENGINE), **leaders}

    def replica_selector_string(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.replica_selector().items())

    @property
    def gateway_name(self) -> str:
        return f"{self.name}-gateway"

    @property
    def gateway_service(self) -> str:
        """Clients' address: `http://<isvc>.<namespace>.svc:8080/v1`."""
        return self.name

    def selector(self, component: str) -> dict[str, str]:
        return selector_of(self.name, component)

    def selector_string(self, component: str) -> str:
        return selector_string(self.name, component)

    def labels(self, component: str) -> dict[str, str]:
        return child_labels(self.name, component, ISVC_LABEL)

    def metadata(self, name: str, component: str, **extra: Json) -> Json:
        return child_metadata(self, KIND, name, component, **extra)

    def gateway_url(self) -> str | None:
        """Where clients reach this service's model: its gateway, or the InferenceGateway
        that fronts it."""
        g = self.spec.gateway
        if not g.enabled:
            return None
        front = g.inference_gateway or self.gateway_service
        return f"http://{front}.{self.namespace}.svc:{GATEWAY_PORT}/v1"


def child_labels(owner: str, component: str, owner_label: str) -> dict[str, str]:
    """The labels of a child of the resource `owner` (its kind's label: ISVC_LABEL, IG_LABEL)."""
    return {
        "app.kubernetes.io/name": "kvfleet",
        "app.kubernetes.io/instance": owner,
        COMPONENT_LABEL: component,
        **MANAGED_BY,
        owner_label: owner,
    }


def child_metadata(owner: GatewayOwnerLike, kind: str, name: str, component: str,
                   **extra: Json) -> Json:  # fmt: skip
    """A child's metadata: its labels, and its owner as controller (garbage collected with it)."""
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": owner.labels(component),
        "ownerReferences": [
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": kind,
                "name": owner.name,
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
        **extra,
    }


def merge_resources(base: Json, requests: dict[str, str], limits: dict[str, str]) -> Json:
    """The default requests/limits with the spec's overrides on top."""
    return {
        "requests": {**base.get("requests", {}), **requests},
        "limits": {**base.get("limits", {}), **limits},
    }


RESTRICTED_CONTAINER: Json = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}
"""The container hardening every image here can live with."""


def service(
    owner: GatewayOwnerLike, name: str, component: str, port: int, **spec: Json | str | bool
) -> Json:
    """A Service for `component`'s pods, its one port named `http` as the pods' port is."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owner.metadata(name, component),
        "spec": {
            **spec,
            "selector": owner.selector(component),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
