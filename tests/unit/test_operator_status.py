"""Status and conditions computed from what the cluster reports: stable when nothing
changes (so the operator writes nothing), and each condition says why."""

from typing import Any

from kvfleet_operator.status import Observed, compute_status, status_patch

SELECTOR = "kvfleet.dev/inferenceservice=x,app.kubernetes.io/component=engine"


def body(generation: int = 1, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "x", "generation": generation}, "status": status or {}}


def pod(name: str, ready: bool, role: str = "active") -> dict[str, Any]:
    cond = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {
        "metadata": {"name": name, "labels": {"kvfleet.dev/role": role}},
        "status": {"conditions": cond},
    }


def deployment(generation: int, observed: int, updated: int) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "status": {"observedGeneration": observed, "updatedReplicas": updated},
    }


GATEWAY_READY = {"status": {"readyReplicas": 1}}


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_serving_and_stable_status_is_unchanged_on_recompute() -> None:
    seen = Observed(deployment(2, 2, 2), [pod("a", True), pod("b", True, "warm")], GATEWAY_READY)
    first = compute_status(body(), 2, SELECTOR, "http://x.ns.svc:8080/v1", seen)
    assert conditions(first) == {
        "Ready": ("True", "Serving"),
        "Progressing": ("False", "Stable"),
        "Degraded": ("False", "AsExpected"),
    }
    assert (first["activeReplicas"], first["warmReplicas"], first["readyReplicas"]) == (1, 1, 2)
    again = compute_status(body(status=first), 2, SELECTOR, "http://x.ns.svc:8080/v1", seen)
    assert again == first and status_patch(first, again) is None


def test_rollout_unready_and_invalid_spec() -> None:
    rolling = Observed(
        deployment(3, 3, 1), [pod("a", True), pod("b", True), pod("c", False)], GATEWAY_READY
    )
    st = compute_status(body(3), 2, SELECTOR, None, rolling)
    assert conditions(st)["Progressing"] == ("True", "RollingOut")
    assert conditions(st)["Ready"] == ("True", "Serving")
    down = Observed(deployment(1, 1, 2), [pod("a", False), pod("b", False)], GATEWAY_READY)
    assert conditions(compute_status(body(), 2, SELECTOR, None, down))["Ready"] == (
        "False",
        "NoReadyReplicas",
    )
    no_gw = Observed(deployment(1, 1, 1), [pod("a", True)], {"status": {}})
    assert conditions(compute_status(body(), 1, SELECTOR, None, no_gw))["Ready"] == (
        "False",
        "GatewayUnavailable",
    )
    new_pod = Observed(deployment(1, 1, 2), [pod("a", True), pod("b", False)], GATEWAY_READY)
    st = compute_status(body(), 2, SELECTOR, None, new_pod)
    assert conditions(st)["Degraded"] == ("False", "AsExpected")  # starting is not failing
    assert conditions(st)["Progressing"] == ("True", "Scaling")
    crashing = pod("b", False)
    crashing["status"]["containerStatuses"] = [
        {"restartCount": 3, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
    ]
    st = compute_status(
        body(),
        2,
        SELECTOR,
        None,
        Observed(deployment(1, 1, 2), [pod("a", True), crashing], GATEWAY_READY),
    )
    assert conditions(st)["Degraded"] == ("True", "ReplicasFailing")
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["message"] == "b: CrashLoopBackOff (3 restarts)"
    bad = compute_status(
        body(4), 0, SELECTOR, None, Observed(None, [], None), "spec.replicas: nope"
    )
    ready = next(c for c in bad["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"], ready["message"]) == (
        "False",
        "InvalidSpec",
        "spec.replicas: nope",
    )
    assert ready["observedGeneration"] == 4


def test_status_patch_removes_only_what_we_own() -> None:
    old = {"gatewayURL": "http://x", "replicas": 2, "metrics": {"queueDepth": 3}, "theirs": 1}
    # The autoscaler's fields are the operator's too: a service no longer autoscaled loses them.
    assert status_patch(old, {"replicas": 2}) == {"gatewayURL": None, "metrics": None}
    new = {"replicas": 3, "gatewayURL": "http://x", "metrics": {"queueDepth": 3}}
    assert status_patch(old, new) == {"replicas": 3}


def test_argocd_health_of_each_status_the_operator_writes() -> None:
    """docs/argocd/inferenceservice-health.lua, run as Argo CD runs it (Lua), on the status
    objects compute_status produces."""
    from tests.support.argocd import health

    def obj(generation: int, status: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"name": "x", "generation": generation}, "status": status}

    stable = Observed(deployment(2, 2, 2), [pod("a", True), pod("b", True)], GATEWAY_READY)
    serving = compute_status(body(), 2, SELECTOR, None, stable)
    assert health(obj(1, serving)) == ("Healthy", "2/2 engine replicas ready")
    assert health(obj(2, serving)) == (  # edited, not yet observed
        "Progressing",
        "Waiting for the kvfleet operator to observe generation 2",
    )
    rolling = Observed(deployment(3, 3, 1), [pod("a", True), pod("b", True)], GATEWAY_READY)
    assert health(obj(1, compute_status(body(), 2, SELECTOR, None, rolling)))[0] == "Progressing"
    bad = compute_status(body(), 0, SELECTOR, None, Observed(None, [], None), "spec.x: nope")
    assert health(obj(1, bad)) == ("Degraded", "spec.x: nope")
    zero = compute_status(body(), 0, SELECTOR, None, Observed(deployment(1, 1, 0), [], None))
    assert health(obj(1, zero)) == ("Suspended", "no replicas requested")
    down = Observed(deployment(1, 1, 2), [pod("a", False), pod("b", False)], GATEWAY_READY)
    assert health(obj(1, compute_status(body(), 2, SELECTOR, None, down))) == (
        "Progressing",
        "0/2 engine replicas ready",
    )
    assert health({"metadata": {"name": "x", "generation": 1}})[0] == "Progressing"


def test_cost_per_1k_tokens_is_read_from_what_the_gateway_exports() -> None:
    """The direct reader's parse of a real gateway exposition: cost over billed tokens, the
    cached tokens (part of the prompt's) not counted twice."""
    from prometheus_client import generate_latest

    from kvfleet_gateway.config import CostConfig
    from kvfleet_gateway.metrics import GatewayMetrics, Usage
    from kvfleet_operator.scaling.observe import parse_gateway

    metrics = GatewayMetrics()
    cost = CostConfig(gpu_hourly_price=3.6)
    spent = sum(
        metrics.record_usage("t", "m", Usage(1000, 200, cached_tokens=600), cost) for _ in range(3)
    )
    totals = parse_gateway(generate_latest(metrics.registry).decode())
    assert totals.tokens == 3 * 1200
    assert abs(totals.cost - spent * 3.6 / 3600) < 1e-9
    per_1k = 1000 * totals.cost / totals.tokens
    # 400 uncached prompt tokens at 20k/s + 200 output at 3k/s per request, $3.6 per GPU-hour
    assert abs(per_1k - 1000 * (400 / 20_000 + 200 / 3_000) * 0.001 / 1200) < 1e-9
