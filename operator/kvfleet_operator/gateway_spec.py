"""The gateway's part of the specs: an InferenceService's own gateway (`spec.gateway`) and
the shared InferenceGateway that fronts many services with one URL, one set of keys, and
one budget per tenant across their models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from kvfleet_gateway.config import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    STORE_PATTERN,
    Limits,
    TenantLimits,
)
from kvfleet_kernel.schema import Rule, fld, parse

IG_KIND, IG_PLURAL = "InferenceGateway", "inferencegateways"

KVFLEET_IMAGE = "ghcr.io/kvfleet/kvfleet:0.1.0"
"""The kvfleet image (gateway, operator); the same version as this package. The operator's
default for its gateways when its own image is not given ($KVFLEET_IMAGE)."""


@dataclass(frozen=True, kw_only=True)
class SecretKey:
    name: str = fld(doc="Secret name (same namespace).")
    key: str = fld("token", "Key inside the Secret.")


@dataclass(frozen=True, kw_only=True)
class ResourceOverrides:
    requests: dict[str, str] = fld(dict, "Extra or overriding resource requests (cpu, memory).")
    limits: dict[str, str] = fld(dict, "Extra or overriding limits; nvidia.com/gpu is managed.")


_FRONT_RULES = (
    Rule(
        "self.replicas == 1 || self.limitsStore != 'memory'",
        "more than one gateway replica needs a shared limitsStore (redis://...): with"
        " memory each replica would enforce the full limits",
        ".limitsStore",
    ),
    Rule(
        "!self.limitsStore.matches('^rediss?://[^/@]*:[^/@]*@')",
        "limitsStore may not carry a password (it would be readable in the spec and the"
        " gateway's ConfigMap): give it as limitsStorePassword, a Secret key",
        ".limitsStore",
    ),
)


@dataclass(frozen=True, kw_only=True)
class GatewayFront:
    """What clients meet: the gateway pods, their keys, and the tenants' limits and budgets
    (an InferenceService's own gateway, or an InferenceGateway shared by many)."""

    replicas: int = fld(1, "Gateway pods (share limits through limitsStore).", minimum=1)
    image: str | None = fld(
        None,
        "The kvfleet image of the gateway. Unset: the operator's own image (the chart's or"
        f" manifests' image, {KVFLEET_IMAGE} in this release), which moves with operator"
        " upgrades — set it to pin an image.",
    )
    api_keys_secret: str | None = fld(
        None, "Secret with `keys.yaml` (tenants and sha256 key hashes; see kvfleet keys)."
    )
    insecure_no_auth: bool = fld(False, "Serve without API keys. Never in production.")
    limits_store: str = fld(
        "memory",
        "memory (one gateway replica) or a redis:// URL shared by all replicas.",
        pattern=STORE_PATTERN,
        max_length=1024,
    )
    limits_store_password: SecretKey | None = fld(
        None,
        "The Redis password (AUTH) of limitsStore, from a Secret key: mounted into the gateway"
        " pods as a file, never written into the spec or the gateway's ConfigMap.",
    )
    limits_scope: str | None = fld(
        None,
        "Whose tenants' budgets and limits these are in the shared limitsStore. Unset: this"
        " resource's own (<namespace>/<name>); gateways given the same scope share their"
        " tenants' budgets.",
        pattern=r"^[^{}\s]+$",
    )
    default_limits: Limits = fld(Limits, "Limits of every tenant.")
    tenants: tuple[TenantLimits, ...] = fld((), "Per-tenant overrides.", max_items=1000)
    service_type: Literal["ClusterIP", "LoadBalancer", "NodePort"] = fld(
        "ClusterIP", "Type of the gateway Service."
    )
    resources: ResourceOverrides = fld(ResourceOverrides, "Resource overrides.")


GATEWAY_KEYS_RULE = Rule(
    "!self.gateway.enabled || has(self.gateway.inferenceGateway)"
    " || self.gateway.insecureNoAuth || has(self.gateway.apiKeysSecret)",
    "an enabled gateway needs apiKeysSecret (or insecureNoAuth: true)",
    ".gateway.apiKeysSecret",
)
"""On the InferenceService's spec, not on `gateway`: the API server checks a field's default
against the field's own rules, and `gateway`'s default ({}) has no keys."""


@dataclass(frozen=True, kw_only=True)
class GatewaySpec(GatewayFront):
    RULES: ClassVar = (
        *_FRONT_RULES,
        Rule(
            "self.prefixIndex != 'events' || self.routingPolicy == 'kvfleet'",
            "prefixIndex: events is read by the kvfleet routing policy only",
            ".prefixIndex",
        ),
        Rule(
            "!has(self.inferenceGateway) || self.prefixIndex != 'events'",
            "prefixIndex: events needs the model's tokenizer in the gateway pods: not yet with"
            " a shared InferenceGateway (use approximate)",
            ".prefixIndex",
        ),
    )
    enabled: bool = fld(True, "Deploy the routing gateway.")
    inference_gateway: str | None = fld(
        None,
        "The InferenceGateway (in this namespace) that fronts this service beside others:"
        " clients reach its models there, with that gateway's keys and tenants; this"
        " service's own gateway is not deployed. Routing settings below still apply to its"
        " pool; replicas, keys, limits and the Service type are the InferenceGateway's.",
        pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$",
        max_length=56,
    )
    routing_policy: str = fld(DEFAULT_POLICY, "How the gateway picks a replica.", enum=POLICY_NAMES)
    prefix_index: Literal["approximate", "events"] = fld(
        "approximate",
        "Where the kvfleet policy learns which replica caches which prefix. approximate: from"
        " what the gateway sent where. events: exactly, from SGLang's KV-cache events (engines"
        " get --kv-events-config; gateways subscribe to every engine and tokenize prompts with"
        " the model's tokenizer, from the model's PVC or fetched from Hugging Face).",
    )
    fair_sharing: FairSharing | None = fld(
        None,
        "Under overload, queue at the gateway and share fairly between tenants (each"
        " tenant's priority and fairShareWeight are limits). Unset: the engines queue what"
        " they cannot run, first come first served.",
    )

    @property
    def own_gateway(self) -> bool:
        """This service deploys a gateway of its own."""
        return self.enabled and self.inference_gateway is None


@dataclass(frozen=True, kw_only=True)
class InferenceGatewaySpec(GatewayFront):
    """One entry point for many InferenceServices: the services that name it in
    `spec.gateway.inferenceGateway` are its pools; a request goes to the pool serving its
    `model` (served names, aliases, LoRA adapters). Tenants, keys, limits and budgets are
    declared once here, across every model (`models` in a tenant's limits is its
    allow-list; `costBudget` spends at each model's `price`)."""

    RULES: ClassVar = (
        Rule(
            "self.insecureNoAuth || has(self.apiKeysSecret)",
            "a gateway needs apiKeysSecret (or insecureNoAuth: true)",
            ".apiKeysSecret",
        ),
        *_FRONT_RULES,
    )


def parse_gateway_spec(spec: object) -> InferenceGatewaySpec:
    """The InferenceGateway's `.spec`, defaulted and validated (raises ConfigError)."""
    return parse(InferenceGatewaySpec, spec, "spec")


@dataclass(frozen=True, kw_only=True)
class FairSharing:
    """When every replica is saturated, requests wait at the gateway and go out by fair share
    of the service each tenant received (VTC), critical before standard before sheddable
    (sheddable refused at once). A replica is saturated at engine.maxRunningRequests requests
    from the gateways (split between gateway replicas); without it, when its engine reports a
    waiting request."""

    max_waiting: int = fld(1000, "Requests waiting per gateway; more are refused.", minimum=1)
    timeout_seconds: int = fld(60, "Longest wait; then 503 with Retry-After.", minimum=1)
    reserve_per_replica: int = fld(
        1,
        "Batch slots per replica kept for a tenant under its fair share, so it starts at once"
        " rather than after a flood's request ends (with engine.maxRunningRequests).",
        minimum=0,
    )
