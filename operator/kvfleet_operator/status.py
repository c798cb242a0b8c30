"""The InferenceService status: its schema (for the CRD) and its pure computation.

`compute_status` reads what the cluster reports — the engine Deployment, the engine pods,
the gateway Deployment — and returns the status document and conditions. Conditions keep
their `lastTransitionTime` while their status does not change, so an unchanged world gives
an identical status and the operator writes nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from kvfleet_kernel.schema import ConfigError, Json, fld, json_name, parse, to_json
from kvfleet_operator.render.common import ROLE_LABEL

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Condition:
    type: str = fld(
        doc="Ready, Progressing, Degraded; ScalingActive (autoscaled); Routed (behind an"
        " InferenceGateway)."
    )
    status: str = fld(doc="True, False or Unknown.")
    reason: str = fld(doc="CamelCase reason.")
    message: str = fld(doc="Human-readable detail; names the spec field when one is at fault.")
    last_transition_time: str = fld(doc="When status last changed.")
    observed_generation: int | None = fld(None, "Generation the condition was computed for.")


@dataclass(frozen=True, kw_only=True)
class LiveMetrics:
    """Fleet signals the autoscaler read (Prometheus, or the pods directly)."""

    queue_depth: float | None = fld(None, "Waiting requests summed over active replicas.")
    kv_cache_usage: float | None = fld(None, "Mean KV-cache usage of active replicas (0..1).")
    ttft_p99: float | None = fld(None, "p99 time to first token over the last 5 minutes, s.")
    arrival_rate: float | None = fld(None, "Requests per second arriving at the gateways.")
    cost_per_1k_tokens: float | None = fld(
        None,
        "GPU cost (gpuHourlyPrice units) per 1,000 tokens billed: over the last 5 minutes"
        " from Prometheus; since the gateway pods started when they are scraped directly.",
    )


@dataclass(frozen=True, kw_only=True)
class AutoscalingStatus:
    """The autoscaler's current decision and the numbers it was made from."""

    desired_active: int | None = fld(None, "Active replicas decided.")
    desired_warm: int | None = fld(None, "Warm spares decided.")
    reason: str | None = fld(None, "Why, in words, with the numbers.")
    holding: bool | None = fld(None, "The size is held for lack of data.")
    source: str | None = fld(None, "Where the signals came from: prometheus or direct.")
    queue_per_replica: float | None = fld(None, "Waiting + held requests per active replica.")
    kv_cache_usage: float | None = fld(None, "Mean KV usage of active replicas.")
    held_requests: float | None = fld(None, "Requests the gateway holds for lack of a replica.")
    recommendation: int | None = fld(None, "This decision's raw recommendation.")
    cold_start_seconds: float | None = fld(
        None, "Learned time from a new pod to a ready replica (prior: spec)."
    )
    bound_by: str | None = fld(
        None, "The term that set the size: forecast, queue, kv, slots, slo, min, max, window."
    )
    forecast_requests_per_second: float | None = fld(
        None, "Arrival rate expected one cold start ahead (Holt's linear trend)."
    )
    forecast_trend_weight: float | None = fld(
        None,
        "Share of the rate's trend the forecast extrapolates (0..1): how much of it came true"
        " in the scored forecasts (0: the trend was noise).",
    )
    capacity_requests_per_second: float | None = fld(
        None, "Requests per second one replica is planned to serve (learned from the fleet)."
    )
    replica_throughput_requests_per_second: float | None = fld(
        None,
        "Requests per second one replica completes at most at the recent request mix, as the"
        " gateways estimate it from their calibrated prefill rate and decode step: where the"
        " capacity plan starts.",
    )
    missing_pods: tuple[str, ...] | None = fld(
        None, "Active pods without fresh metrics: counted saturated, no scale-down."
    )
    last_decision_time: str | None = fld(None, "When the decision or its numbers last changed.")
    last_scale_time: str | None = fld(None, "When the desired size last changed.")


@dataclass(frozen=True, kw_only=True)
class InferenceServiceStatus:
    observed_generation: int | None = fld(None, "metadata.generation last reconciled.")
    conditions: tuple[Condition, ...] = fld((), "Ready, Progressing, Degraded.")
    replicas: int | None = fld(None, "Engine pods (active + warm): the scale subresource.")
    desired_replicas: int | None = fld(None, "Engine pods the operator asks for.")
    active_replicas: int | None = fld(None, "Ready pods taking traffic.")
    warm_replicas: int | None = fld(None, "Ready spares (loaded, no traffic).")
    ready_replicas: int | None = fld(None, "Ready engine pods.")
    selector: str | None = fld(None, "Label selector of the engine pods (scale subresource).")
    gateway_url: str | None = fld(
        None, "In-cluster URL of the gateway's OpenAI API.", name="gatewayURL"
    )
    metrics: LiveMetrics | None = fld(None, "Live fleet signals.")
    autoscaling: AutoscalingStatus | None = fld(None, "The autoscaler's decision.")


@dataclass(frozen=True)
class Observed:
    """What the cluster reports about an InferenceService's children."""

    engine: Json | None
    pods: list[Json]
    gateway: Json | None
    held: tuple[str, ...] = ()
    """Pods (engine or gateway) held before their container starts by an object that does
    not exist, in the kubelet's words: `pod x: ... secret "keys" not found`."""
    conflicts: tuple[str, ...] = ()
    """Children's names taken by objects this InferenceService does not control, each said
    as the condition says it (left untouched: the operator adopts nothing)."""
    refused: tuple[str, ...] = ()
    """Children the API server refused (kind, name, status code, its message)."""
    invalid_keys: str | None = None
    """Why the gateway refuses its API-key Secret (the field named), read while no gateway
    pod is ready."""


def pod_ready(pod: Json) -> bool:
    status = pod.get("status") or {}
    return not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


FAILING_REASONS = frozenset(
    {"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError"}
)


def failing_pods(pods: list[Json]) -> list[str]:
    """Engine pods that are not starting but failing: crash loops, pull errors, restarts
    while unready. A pod that is merely new (scale-up, replacement) is Progressing, not this."""
    out = []
    for p in pods:
        if pod_ready(p):
            continue
        for cs in (p.get("status") or {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            restarts = int(cs.get("restartCount") or 0)
            if waiting.get("reason") in FAILING_REASONS or restarts > 0:
                why = waiting.get("reason") or "restarting"
                said = last_words(cs)
                out.append(
                    f"{p['metadata']['name']}: {why} ({restarts} restarts)"
                    + (f": {said}" if said else "")
                )
                break
    return out


def unschedulable(pod: Json) -> str | None:
    """The scheduler's message when it found no node for `pod` (its condition
    `PodScheduled=False, reason=Unschedulable`, e.g. `0/3 nodes are available: 3 Insufficient
    nvidia.com/gpu`), else None: such a pod is not capacity on the way, it waits for a node."""
    if pod["metadata"].get("deletionTimestamp"):
        return None
    for c in (pod.get("status") or {}).get("conditions") or []:
        placing = (c.get("type"), c.get("status"), c.get("reason"))
        if placing == ("PodScheduled", "False", "Unschedulable"):
            return " ".join(str(c.get("message") or "no node fits").split())
    return None


def unschedulable_summary(pods: list[Json]) -> str | None:
    """What a condition says of the pods no node fits: how many, which, and the scheduler's
    words (the shortage) for the first; None when every pod is placed or placing."""
    said = [(p["metadata"]["name"], m) for p in pods if (m := unschedulable(p)) is not None]
    if not said:
        return None
    names = ", ".join(sorted(n for n, _ in said)[:3]) + (", ..." if len(said) > 3 else "")
    plural = "s" if len(said) > 1 else ""
    return f"{len(said)} engine pod{plural} cannot be scheduled ({names}): {said[0][1]}"


LAST_WORDS_CHARS = 300
"""Of a container's termination message, what a condition quotes (its end: the error)."""


def last_words(container_status: Json) -> str:
    """What the container's last run said as it ended — its termination message (written to
    terminationMessagePath, or its log's tail under FallbackToLogsOnError): the exit code
    and the end of the message, on one line."""
    ended = (container_status.get("lastState") or {}).get("terminated") or (
        (container_status.get("state") or {}).get("terminated") or {}
    )
    if not ended:
        return ""
    message = " ".join(str(ended.get("message") or "").split())
    if len(message) > LAST_WORDS_CHARS:
        message = "..." + message[-LAST_WORDS_CHARS:]
    code = ended.get("exitCode")
    return (
        f"exit code {code}" + (f", {message}" if message else "") if code is not None else message
    )


def k8s_time(t: float | None = None) -> str:
    """A Kubernetes timestamp (RFC 3339, seconds, UTC) of Unix time `t`, or of now."""
    moment = datetime.now(UTC) if t is None else datetime.fromtimestamp(t, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(
    previous: list[Json], type_: str, ok: bool, reason: str, message: str, generation: int
) -> Condition:
    status = "True" if ok else "False"
    old = next((c for c in previous if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status else k8s_time()
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )


ROUTED = "Routed"
"""The condition an InferenceGateway's reconcile writes on each service naming it: served
there, or left out and why (a name another service claimed first). The service's own
reconcile keeps it as written while the service names a gateway."""


def _kept(cls: type[T], value: Any) -> T | None:
    """A status part the last writer recorded, read back typed (None: absent or unreadable,
    e.g. written by an older operator)."""
    if not value:
        return None
    try:
        return parse(cls, value)
    except ConfigError:
        return None


def compute_status(
    body: Json,
    desired_replicas: int,
    selector: str,
    gateway_url: str | None,
    observed: Observed,
    error: str | None = None,
    error_reason: str = "InvalidSpec",
    scaling: ScalingReport | None = None,
    keep_scaling: bool = False,
) -> Json:
    """The status document for `body`, given its children; `error` is a spec problem
    (`error_reason` its conditions' reason);
    `scaling` the autoscaler's report (autoscaled services only)."""
    old = dict(body.get("status") or {})
    previous = list(old.get("conditions") or [])
    generation = int(body["metadata"].get("generation") or 1)
    ready_pods = [p for p in observed.pods if pod_ready(p)]
    roles = [(p["metadata"].get("labels") or {}).get(ROLE_LABEL) for p in ready_pods]
    warm = sum(1 for r in roles if r == "warm")
    active = len(ready_pods) - warm
    dep_status = (observed.engine or {}).get("status") or {}
    dep_gen_ok = (observed.engine is None) or (
        dep_status.get("observedGeneration") == observed.engine["metadata"].get("generation")
    )
    updated = int(dep_status.get("updatedReplicas") or 0)
    rolling = not dep_gen_ok or updated < desired_replicas or len(observed.pods) > desired_replicas
    gw_ready = (
        observed.gateway is None
        or int(((observed.gateway.get("status") or {}).get("readyReplicas")) or 0) >= 1
    )
    if error is not None:
        conds = [
            condition(previous, "Ready", False, error_reason, error, generation),
            condition(previous, "Progressing", False, error_reason, error, generation),
            condition(previous, "Degraded", True, error_reason, error, generation),
        ]
    else:
        serving = active >= 1 and gw_ready
        unplaced = unschedulable_summary(observed.pods)
        want = f"{len(ready_pods)}/{desired_replicas} engine replicas ready"
        if observed.refused:
            ready_c = condition(
                previous, "Ready", False, "ReconcileError", "; ".join(observed.refused[:3]),
                generation,
            )  # fmt: skip
        elif observed.conflicts:
            ready_c = condition(
                previous, "Ready", False, "NameConflict", "; ".join(observed.conflicts[:3]),
                generation,
            )  # fmt: skip
        elif desired_replicas == 0:
            ready_c = condition(
                previous, "Ready", False, "ScaledToZero", "no replicas requested", generation
            )
        elif serving:
            ready_c = condition(previous, "Ready", True, "Serving", want, generation)
        elif observed.invalid_keys:
            ready_c = condition(
                previous, "Ready", False, "InvalidKeys", observed.invalid_keys, generation
            )
        elif observed.held:
            ready_c = condition(
                previous, "Ready", False, "ReferenceNotFound", "; ".join(observed.held[:3]),
                generation,
            )  # fmt: skip
        elif unplaced is not None:  # before the gateway: it waits on these engines
            ready_c = condition(previous, "Ready", False, "Unschedulable", unplaced, generation)
        elif not gw_ready:
            store = ((body.get("spec") or {}).get("gateway") or {}).get("limitsStore")
            why = (  # not the URL itself: it may carry a password
                " (a gateway is not ready while no engine answers it or, every tenant being"
                " budgeted, while its limits store, spec.gateway.limitsStore, does not)"
                if store
                else " (a gateway is not ready while no engine answers it)"
            )
            ready_c = condition(
                previous,
                "Ready",
                False,
                "GatewayUnavailable",
                "no gateway pod is ready" + why,
                generation,
            )
        else:
            ready_c = condition(previous, "Ready", False, "NoReadyReplicas", want, generation)
        progressing = rolling or len(ready_pods) < desired_replicas
        prog_msg = (
            f"rolling out: {updated}/{desired_replicas} replicas updated"
            if rolling
            else (want if progressing else "all replicas are current and ready")
        )
        failing = failing_pods(observed.pods)
        degraded = bool(failing) or bool(observed.invalid_keys) or unplaced is not None
        degraded_reason = (
            "ReplicasFailing" if failing else ("Unschedulable" if unplaced else "AsExpected")
        )
        degraded_msg = "; ".join(failing[:3]) if failing else (unplaced or want)
        if observed.invalid_keys:  # no request is served, whatever the engines do
            degraded_reason, degraded_msg = "InvalidKeys", observed.invalid_keys
        conds = [
            ready_c,
            condition(
                previous,
                "Progressing",
                progressing,
                "RollingOut" if rolling else ("Scaling" if progressing else "Stable"),
                prog_msg,
                generation,
            ),
            condition(
                previous,
                "Degraded",
                degraded,
                degraded_reason,
                degraded_msg,
                generation,
            ),
        ]
    autoscaling: AutoscalingStatus | None = None
    metrics: LiveMetrics | None = None
    if scaling is None and error is None and keep_scaling:
        # Autoscaled, but no decision yet in this operator (it just started): keep what the
        # last one recorded, so a restart neither forgets nor rewrites it.
        conds += [
            kept
            for c in previous
            if c.get("type") == "ScalingActive" and (kept := _kept(Condition, c)) is not None
        ]
        autoscaling = _kept(AutoscalingStatus, old.get("autoscaling"))
        metrics = _kept(LiveMetrics, old.get("metrics"))
    if scaling is not None and error is None:
        conds.append(
            condition(
                previous,
                "ScalingActive",
                scaling.active,
                scaling.condition_reason,
                scaling.condition_message,
                generation,
            )
        )
        autoscaling, metrics = scaling.autoscaling, scaling.metrics
    if ((body.get("spec") or {}).get("gateway") or {}).get("inferenceGateway"):
        conds += [
            kept
            for c in previous
            if c.get("type") == ROUTED and (kept := _kept(Condition, c)) is not None
        ]
    status = InferenceServiceStatus(
        observed_generation=generation,
        conditions=tuple(conds),
        replicas=len(observed.pods),
        desired_replicas=desired_replicas,
        active_replicas=active,
        warm_replicas=warm,
        ready_replicas=len(ready_pods),
        selector=selector,
        gateway_url=gateway_url or None,
        metrics=metrics,
        autoscaling=autoscaling,
    )
    out: Json = to_json(status)
    return out


@dataclass(frozen=True)
class ScalingReport:
    """What the autoscaler contributes to the status."""

    active: bool
    """ScalingActive: the autoscaler has the data it needs."""
    condition_reason: str
    condition_message: str
    autoscaling: AutoscalingStatus
    metrics: LiveMetrics | None


@dataclass(frozen=True, kw_only=True)
class InferenceGatewayStatus:
    """Observed state, written by the operator."""

    observed_generation: int | None = fld(None, "The spec generation last reconciled.")
    url: str | None = fld(None, "In-cluster URL of the gateway's OpenAI API.")
    ready_replicas: int = fld(0, "Gateway pods ready.")
    services: tuple[str, ...] = fld((), "InferenceServices served here.")
    models: tuple[str, ...] = fld((), "Model names served here (names, aliases, adapters).")
    left_out: tuple[str, ...] = fld(
        (), "InferenceServices that name this gateway but are not served, and why."
    )
    conditions: tuple[Condition, ...] = fld((), "Ready.")


OWNED_STATUS = tuple(
    json_name(f)
    for cls in (InferenceServiceStatus, InferenceGatewayStatus)
    for f in dataclasses.fields(cls)
)
"""Status fields this module writes (of either kind); a field `new` lacks is removed."""


def status_patch(old: Any, new: Json) -> Json | None:
    """The merge patch from `old` to `new` status (None when equal); fields we own that
    `new` lacks are removed (null), fields others own are left alone."""
    old = old or {}
    patch: Json = {k: v for k, v in new.items() if old.get(k) != v}
    patch |= {k: None for k in OWNED_STATUS if k in old and k not in new}
    return patch or None
