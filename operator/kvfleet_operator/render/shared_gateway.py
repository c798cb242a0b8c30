"""An InferenceGateway: one gateway Deployment + Service (+ RBAC, NetworkPolicy, PDB,
PodMonitor) in front of every InferenceService that names it.

Its ConfigMap holds what is the gateway's own (listen, keys, tenants, limits); the services'
pools live in a Secret beside it (`<name>-pools`: `pools.yaml` and each service's engines'
key), which the kubelet refreshes in the running pods: the gateway re-reads the file and
starts or stops pools, so a service joining or leaving rolls nothing. A pool's key file is
named after the key's digest, so a rotated key is a changed pool (started again, with the
new key).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

import yaml

from kvfleet_gateway.config import ConfigError, GatewayConfig, PoolConfig, parse_pools
from kvfleet_kernel.schema import Json, to_json
from kvfleet_operator.gateway_spec import (
    IG_KIND,
    KVFLEET_IMAGE,
    InferenceGatewaySpec,
    parse_gateway_spec,
)
from kvfleet_operator.render.common import (
    DEFAULT_OPERATOR_NAMESPACE,
    GATEWAY,
    IG_LABEL,
    Owner,
    child_labels,
    child_metadata,
    shared_gateway_selector,
)
from kvfleet_operator.render.gateway import (
    LISTEN,
    GatewayPodExtras,
    auth_doc,
    gateway_configmap,
    gateway_pods,
    gateway_rbac,
    gateway_service,
    limits_doc,
    pool_doc,
)
from kvfleet_operator.render.network import gateway_network_policy, gateway_pod_monitor

POOLS_DIR, POOLS_KEY = "/etc/kvfleet/pools", "pools.yaml"


@dataclass(frozen=True)
class GatewayOwner:
    """The InferenceGateway its children belong to, as the renderers need it."""

    name: str
    namespace: str
    uid: str
    spec: InferenceGatewaySpec
    generation: int = 1
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE
    gateway_image: str = KVFLEET_IMAGE
    """The gateway's image when `spec.image` is unset: the operator's own."""

    @property
    def gateway_name(self) -> str:
        return f"{self.name}-gateway"

    @property
    def gateway_service(self) -> str:
        """Clients' address: `http://<name>.<namespace>.svc:8080/v1`."""
        return self.name

    @property
    def pools_secret(self) -> str:
        return f"{self.name}-pools"

    def selector(self, component: str) -> dict[str, str]:
        return shared_gateway_selector(self.name) if component == GATEWAY else {}

    def labels(self, component: str) -> dict[str, str]:
        return child_labels(self.name, component, IG_LABEL)

    def metadata(self, name: str, component: str, **extra: Json) -> Json:
        return child_metadata(self, IG_KIND, name, component, **extra)


@dataclass(frozen=True)
class Fronted:
    """A service this gateway fronts, with its engines' key (read from its Secret)."""

    owner: Owner
    engine_key: str
    created: str = ""
    """Its creationTimestamp (RFC 3339): of two services claiming one name, the earlier
    keeps it."""

    def names(self) -> list[str]:
        """Every name clients may send for it: served name, aliases, adapters."""
        m = self.owner.spec.model
        lora = self.owner.spec.lora
        return [m.name, *m.aliases, *(a.name for a in (lora.adapters if lora else ()))]

    @property
    def key_file(self) -> str:
        digest = hashlib.sha256(self.engine_key.encode()).hexdigest()[:12]
        return f"{self.owner.name}.{digest}.key"


def shared_gateway_config(gw: GatewayOwner) -> GatewayConfig:
    """The gateway's own settings; its pools come from the pools file (raises ConfigError)."""
    doc = {
        "listen": LISTEN,
        "poolsFile": f"{POOLS_DIR}/{POOLS_KEY}",
        "auth": auth_doc(gw.spec),
        "limits": limits_doc(gw.spec, f"{gw.namespace}/{gw.name}"),
    }
    return GatewayConfig.from_dict(doc)


def admit(gw: GatewayOwner, services: list[Fronted]) -> tuple[list[Fronted], dict[str, str]]:
    """The services the gateway can serve together, oldest first, and why each other one is
    left out (by name): a pool the gateway would refuse, or a name an earlier service already
    claims. One service's mistake leaves that service out, never the others."""
    admitted: list[Fronted] = []
    left_out: dict[str, str] = {}
    claimed: dict[str, str] = {}
    for f in sorted(services, key=lambda f: (f.created, f.owner.name)):
        taken = next((n for n in f.names() if n in claimed), None)
        if taken is not None:
            left_out[f.owner.name] = (
                f"model name {taken!r} is already served on InferenceGateway {gw.name} by"
                f" InferenceService {claimed[taken]} (created earlier): this service is left"
                " out until one of them changes"
            )
            continue
        try:
            pools(gw, [f])
        except ConfigError as exc:
            left_out[f.owner.name] = f"its pool is invalid ({exc})"
            continue
        claimed.update((n, f.owner.name) for n in f.names())
        admitted.append(f)
    return admitted, left_out


def pools(gw: GatewayOwner, services: list[Fronted]) -> tuple[PoolConfig, ...]:
    """One pool per service, named `<namespace>/<name>` (raises ConfigError: two services
    claiming one model name)."""
    docs = [
        {"name": f"{f.owner.namespace}/{f.owner.name}",
         **pool_doc(f.owner, f.key_file)}
        for f in sorted(services, key=lambda f: f.owner.name)
    ]  # fmt: skip
    return parse_pools({"pools": docs}, f"InferenceGateway {gw.name}")


def pools_secret(gw: GatewayOwner, services: list[Fronted]) -> Json:
    text = yaml.safe_dump({"pools": _pool_dicts(gw, services)}, sort_keys=False)
    data = {POOLS_KEY: text, **{f.key_file: f.engine_key for f in services}}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": gw.metadata(gw.pools_secret, GATEWAY),
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def _pool_dicts(gw: GatewayOwner, services: list[Fronted]) -> list[Json]:
    return [to_json(p) for p in pools(gw, services)]


def render_shared_gateway(gw: GatewayOwner, services: list[Fronted]) -> list[Json]:
    """Every child of the InferenceGateway, in apply order (raises ConfigError)."""
    config = gateway_configmap(gw, shared_gateway_config(gw))
    secret = pools_secret(gw, services)
    volumes = [{"name": "pools", "secret": {"secretName": gw.pools_secret}}]
    mounts = [{"name": "pools", "mountPath": POOLS_DIR, "readOnly": True}]
    deployment = gateway_pods(gw, gw.spec, config, GatewayPodExtras(volumes, mounts, [], {}))
    return [
        *gateway_rbac(gw),
        config,
        secret,
        deployment,
        gateway_service(gw, gw.spec),
        gateway_network_policy(gw),
        gateway_pdb(gw),
        gateway_pod_monitor(gw, shared=True),
    ]


def gateway_pdb(gw: GatewayOwner) -> Json:
    """A node drain takes one gateway pod at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": gw.metadata(gw.gateway_name, GATEWAY),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": gw.selector(GATEWAY)}},
    }


def gateway_owner_of(
    body: Json,
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE,
    gateway_image: str = KVFLEET_IMAGE,
) -> GatewayOwner:
    """An InferenceGateway object → GatewayOwner, parsing its spec (raises ConfigError)."""
    meta = body.get("metadata") or {}
    name = str(meta.get("name") or "")
    if not name or len(name) > 56:
        raise ConfigError("metadata.name", "an InferenceGateway's name has 1..56 characters")
    return GatewayOwner(
        name=name,
        namespace=meta.get("namespace") or "default",
        uid=meta.get("uid") or "",
        spec=parse_gateway_spec(body.get("spec")),
        generation=int(meta.get("generation") or 1),
        operator_namespace=operator_namespace,
        gateway_image=gateway_image,
    )
