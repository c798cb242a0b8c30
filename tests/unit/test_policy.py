"""The operator's policy over what a spec may set: each rule refuses, naming the field, and a
spec within it passes."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_operator.policy import Policy, PolicyViolation, check_policy
from kvfleet_operator.spec import parse_spec
from tests.support.objects import isvc


def spec(**over: Any) -> Any:
    return parse_spec(isvc(**over)["spec"])


def refusal(policy: Policy, **over: Any) -> str:
    with pytest.raises(PolicyViolation) as caught:
        check_policy(spec(**over), policy)
    return str(caught.value)


def test_the_default_policy_allows_everything_a_spec_can_say() -> None:
    check_policy(
        spec(
            engine={"gpuType": "h100", "image": "anything.example/x:latest"},
            scheduling={"tolerations": [{"operator": "Exists"}], "priorityClassName": "top"},
            gateway={"insecureNoAuth": True, "serviceType": "LoadBalancer"},
        ),
        Policy(),
    )


@pytest.mark.parametrize(
    ("image", "allowed"),
    [
        ("registry.corp/sglang:v1", True),
        ("registry.corp.evil.com/sglang:v1", False),  # a prefix ends at a boundary
        ("lmsysorg/sglang:v0.5.3", True),
        ("lmsysorg/sglang-evil:v0.5.3", False),
        ("lmsysorg/sglang@sha256:" + "a" * 64, True),
        ("docker.io/lmsysorg/sglang:v0.5.3", False),  # the allowed spelling is the one given
    ],
)
def test_images_come_from_an_allowed_registry(image: str, allowed: bool) -> None:
    policy = Policy(allowed_image_prefixes=("registry.corp", "lmsysorg/sglang"))
    over = {"engine": {"gpuType": "h100", "image": image}}
    if allowed:
        check_policy(spec(**over), policy)
    else:
        said = refusal(policy, **over)
        assert said.startswith(f"spec.engine.image: image {image!r} is not from an allowed")


def test_the_gateway_image_too_and_unset_images_are_the_operators_own() -> None:
    policy = Policy(allowed_image_prefixes=("registry.corp/",), require_image_digest=True)
    check_policy(spec(), policy)  # the release's defaults: not the author's choice
    said = refusal(policy, gateway={"insecureNoAuth": True, "image": "registry.corp/kvfleet:1"})
    assert said.startswith("spec.gateway.image:") and "pinned by digest" in said


def test_tolerations_name_allowed_taint_keys_only() -> None:
    policy = Policy(allowed_toleration_keys=("nvidia.com/gpu",))
    ok = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    check_policy(spec(scheduling={"tolerations": [ok]}), policy)
    said = refusal(policy, scheduling={"tolerations": [ok, {"operator": "Exists"}]})
    assert said.startswith("spec.scheduling.tolerations[1]:") and "every taint" in said
    said = refusal(Policy(allowed_toleration_keys=()), scheduling={"tolerations": [ok]})
    assert "(none are)" in said


def test_priority_classes_exposure_and_keyless_gateways() -> None:
    said = refusal(Policy(allowed_priority_classes=("batch",)),
                   scheduling={"priorityClassName": "system-node-critical"})  # fmt: skip
    assert said.startswith("spec.scheduling.priorityClassName:") and "(allowed: batch)" in said
    said = refusal(Policy(allow_insecure_no_auth=False))  # isvc() serves without keys
    assert said.startswith("spec.gateway.insecureNoAuth:")
    said = refusal(
        Policy(allow_external_service=False),
        gateway={"insecureNoAuth": True, "serviceType": "NodePort"},
    )
    assert said.startswith("spec.gateway.serviceType: NodePort exposes the gateway")
