"""The platform team's policy over what an InferenceService's author may set.

An InferenceService is written by whoever may edit that namespace; the operator that renders it
runs with the platform's rights. This policy, set once on the operator (`kvfleet operator
--allowed-image-prefix ...`, Helm's `policy.*`), bounds what such a user can make it create:
which images its pods run, which taints they tolerate, which priority they preempt with,
whether a gateway may serve without keys or be exposed outside the cluster. A spec that
oversteps is not rendered at all: `Ready=False, reason=PolicyViolation` names the field.

Only values the user set are checked: the operator's own default images are the platform's
choice (they come with its release).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_kernel.schema import ConfigError
from kvfleet_operator.gateway_spec import GatewayFront
from kvfleet_operator.spec import InferenceServiceSpec


class PolicyViolation(ConfigError):
    """A field the operator's policy does not let this spec set."""


@dataclass(frozen=True)
class Policy:
    allowed_image_prefixes: tuple[str, ...] = ()
    """Images (engine, gateway) must start with one of these registries or repositories
    (`registry.corp.example/`, `lmsysorg/sglang`) or be one of them exactly (a digest
    reference); empty: any image."""
    require_image_digest: bool = False
    """Images must be pinned by digest (`...@sha256:...`), not by a tag that can move."""
    allowed_toleration_keys: tuple[str, ...] | None = None
    """Taint keys tolerations may name (`nvidia.com/gpu`); None: any; empty: no tolerations.
    A toleration without a key tolerates every taint and is allowed only when None."""
    allowed_priority_classes: tuple[str, ...] | None = None
    """PriorityClasses engine pods may use; None: any; empty: none."""
    allow_insecure_no_auth: bool = True
    """May a gateway serve without API keys (`gateway.insecureNoAuth`)."""
    allow_external_service: bool = True
    """May a gateway Service be a LoadBalancer or NodePort (reachable from outside)."""


def _image_allowed(image: str, prefixes: tuple[str, ...]) -> bool:
    """`image` is one of `prefixes`, or extends one at a boundary: `registry.corp` admits
    `registry.corp/x:1` but not `registry.corp.evil.com/x`."""
    for prefix in prefixes:
        if image == prefix:
            return True
        if prefix.endswith(("/", ":", "@")):
            if image.startswith(prefix):
                return True
        elif image.startswith((f"{prefix}/", f"{prefix}:", f"{prefix}@")):
            return True
    return False


def _check_image(path: str, image: str | None, policy: Policy) -> None:
    if image is None:
        return
    if policy.allowed_image_prefixes and not _image_allowed(image, policy.allowed_image_prefixes):
        allowed = ", ".join(policy.allowed_image_prefixes)
        raise PolicyViolation(path, f"image {image!r} is not from an allowed registry ({allowed})")
    if policy.require_image_digest and "@sha256:" not in image:
        raise PolicyViolation(path, f"image {image!r} must be pinned by digest (@sha256:...)")


def check_policy(spec: InferenceServiceSpec, policy: Policy) -> None:
    """Raise `PolicyViolation` naming the first field of `spec` that `policy` forbids."""
    _check_image("spec.engine.image", spec.engine.image, policy)
    keys = policy.allowed_toleration_keys
    for i, toleration in enumerate(spec.scheduling.tolerations):
        key = toleration.get("key")
        if keys is not None and key not in keys:
            named = f"key {key!r}" if key else "no key (every taint)"
            raise PolicyViolation(
                f"spec.scheduling.tolerations[{i}]",
                f"a toleration with {named} is not allowed"
                + (f" (allowed keys: {', '.join(keys)})" if keys else " (none are)"),
            )
    classes = policy.allowed_priority_classes
    pc = spec.scheduling.priority_class_name
    if pc is not None and classes is not None and pc not in classes:
        raise PolicyViolation(
            "spec.scheduling.priorityClassName",
            f"priority class {pc!r} is not allowed"
            + (f" (allowed: {', '.join(classes)})" if classes else " (none are)"),
        )
    check_gateway_policy("spec.gateway", spec.gateway, policy)


def check_gateway_policy(where: str, g: GatewayFront, policy: Policy) -> None:
    """The bounds on a gateway: an InferenceService's own (`where`: spec.gateway) or an
    InferenceGateway (spec)."""
    _check_image(f"{where}.image", g.image, policy)
    if g.insecure_no_auth and not policy.allow_insecure_no_auth:
        raise PolicyViolation(
            f"{where}.insecureNoAuth", "serving without API keys is not allowed here"
        )
    if g.service_type != "ClusterIP" and not policy.allow_external_service:
        raise PolicyViolation(
            f"{where}.serviceType",
            f"{g.service_type} exposes the gateway outside the cluster, which is"
            " not allowed here (use ClusterIP behind your ingress)",
        )
