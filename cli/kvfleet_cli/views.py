"""What the admin commands print, from the objects they read. Pure functions.

Tables follow kubectl's: upper-case headers, columns padded with three spaces, `<none>` /
`-` for what is unknown, ages like `5m12s` / `3h` / `12d`.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

from kvfleet_operator.render.common import COMPONENT_LABEL, ROLE_LABEL, is_group_worker
from kvfleet_operator.status import pod_ready

Json = dict[str, Any]


def parse_time(stamp: str | None) -> datetime.datetime | None:
    if not stamp:
        return None
    try:
        return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    except ValueError:
        return None


def age(stamp: str | None, now: datetime.datetime) -> str:
    """kubectl's short durations: 45s, 5m12s, 3h4m, 12d."""
    then = parse_time(stamp)
    if then is None:
        return "<unknown>"
    s = max(0, int((now - then).total_seconds()))
    if s < 120:
        return f"{s}s"
    if s < 600:
        return f"{s // 60}m{s % 60}s"
    if s < 3 * 3600:
        return f"{s // 60}m"
    if s < 8 * 3600:
        return f"{s // 3600}h{(s % 3600) // 60}m"
    if s < 2 * 86400:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in [list(headers), *rows]]  # fmt: skip
    return "\n".join(lines) + "\n"


def condition(obj: Json, kind: str) -> Json:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return dict(c)
    return {}


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def isvc_row(obj: Json, now: datetime.datetime, wide: bool, namespaced: bool) -> list[str]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    metrics = status.get("metrics") or {}
    meta = obj["metadata"]
    ready = condition(obj, "Ready")
    row = [
        meta["name"],
        (spec.get("model") or {}).get("name", "<none>"),
        f"{status.get('readyReplicas', 0)}/{status.get('desiredReplicas', '-')}",
        str(status.get("activeReplicas", 0)),
        str(status.get("warmReplicas", 0)),
        _num(metrics.get("queueDepth"), "{:g}"),
        _num(metrics.get("kvCacheUsage"), "{:.0%}"),
        _num(None if metrics.get("ttftP99") is None else metrics["ttftP99"] * 1000, "{:.0f}ms"),
        _num(metrics.get("costPer1kTokens"), "{:.4f}"),
        age(meta.get("creationTimestamp"), now),
    ]
    if wide:
        engine = spec.get("engine") or {}
        row += [
            f"{engine.get('tensorParallel', 1)}x {engine.get('gpuType', '?')}",
            "autoscaled" if spec.get("autoscaling") else "manual",
            ready.get("reason", "<none>"),
            status.get("gatewayURL", "<none>"),
        ]
    return ([meta.get("namespace", "")] if namespaced else []) + row


ISVC_HEADERS = [
    "NAME", "MODEL", "READY", "ACTIVE", "WARM", "QUEUE", "KV", "TTFT-P99", "COST/1K", "AGE"
]  # fmt: skip
ISVC_WIDE = ["GPUS", "SCALING", "REASON", "GATEWAY"]


def isvc_table(items: list[Json], now: datetime.datetime, wide: bool, all_ns: bool) -> str:
    headers = (["NAMESPACE"] if all_ns else []) + ISVC_HEADERS + (ISVC_WIDE if wide else [])
    return table(headers, [isvc_row(o, now, wide, all_ns) for o in items])


def _ready(obj: Json) -> str:
    status = obj.get("status") or {}
    want = (obj.get("spec") or {}).get("replicas")
    return f"{status.get('readyReplicas', 0)}/{want if want is not None else '-'}"


def _role(labels: dict[str, str]) -> str:
    """A pod's role: active or warm; a multi-node replica's worker pods are workers."""
    if is_group_worker(labels):
        return "worker"
    return labels.get(ROLE_LABEL, "-")


def _trend(decision: dict[str, Any]) -> str:
    """How much of the rate's trend the forecast believed ('' when not reported)."""
    weight = decision.get("forecastTrendWeight")
    return "" if weight is None else f" ({weight:.0%} of the trend extrapolated)"


def _roofline(decision: dict[str, Any]) -> str:
    """The gateways' estimate of a replica's throughput ('' when not reported)."""
    bound = decision.get("replicaThroughputRequestsPerSecond")
    return "" if bound is None else f" (a replica completes at most {bound:g} at the mix)"


def describe(
    obj: Json, children: list[Json], pods: list[Json], events: list[Json], now: datetime.datetime
) -> str:
    """`kvfleet describe`: the spec in brief, children and their health, pods, conditions,
    the autoscaler's last decision with its numbers, recent events."""
    spec, status, meta = obj.get("spec") or {}, obj.get("status") or {}, obj["metadata"]
    model, engine = spec.get("model") or {}, spec.get("engine") or {}
    source = model.get("source") or {}
    out = [
        f"Name:         {meta['name']}",
        f"Namespace:    {meta.get('namespace', '')}",
        f"Age:          {age(meta.get('creationTimestamp'), now)}",
        f"Model:        {model.get('name', '<none>')}"
        + (f" ({', '.join(f'{k}: {v}' for k, v in source.items())})" if source else ""),
        f"Engine:       {engine.get('tensorParallel', 1)}x {engine.get('gpuType', '?')}"
        f" per replica",
        f"Replicas:     {status.get('readyReplicas', 0)} ready of "
        f"{status.get('desiredReplicas', '-')} desired ({status.get('activeReplicas', 0)} "
        f"active, {status.get('warmReplicas', 0)} warm)",
    ]
    scaling = spec.get("autoscaling")
    if scaling:
        out.append(
            f"Autoscaling:  {scaling.get('minReplicas', '?')} active at least, "
            f"{scaling.get('maxReplicas', '?')} replicas at most (active + warm), "
            f"{scaling.get('warmReplicas', 0)} warm; targets: queue "
            f"{scaling.get('targetQueueDepth', '-')}/replica, KV "
            f"{scaling.get('targetKvCacheUsage', '-')}"
        )
        out += warm_line(scaling, status)
    gateway = spec.get("gateway") or {}
    enabled = gateway.get("enabled", True)
    out.append(f"Gateway:      {status.get('gatewayURL', '<none>') if enabled else 'disabled'}")
    decision = status.get("autoscaling")
    if decision:
        numbers = ", ".join(
            f"{k}={decision[k]}"
            for k in ("queuePerReplica", "kvCacheUsage", "heldRequests", "recommendation")
            if k in decision
        )
        demand = (
            f"  demand: forecast {decision['forecastRequestsPerSecond']:g} req/s one cold start"
            f" ahead{_trend(decision)}, capacity {decision.get('capacityRequestsPerSecond', '?')}"
            f" req/s per replica{_roofline(decision)}"
            if "forecastRequestsPerSecond" in decision
            else "  demand: no forecast yet (no arrival rate from the gateways)"
        )
        out += [
            "Last scaling decision:",
            f"  {decision.get('desiredActive')} active + {decision.get('desiredWarm')} warm: "
            f"{decision.get('reason', '')}",
            f"  signals ({decision.get('source', '?')}): {numbers}; bound by "
            f"{decision.get('boundBy', '-')}",
            demand,
            f"  decided {age(decision.get('lastDecisionTime'), now)} ago; last resize "
            f"{age(decision.get('lastScaleTime'), now)} ago",
        ]
    conds = status.get("conditions") or []
    out += ["Conditions:"]
    out += _indent(
        table(
            ["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"],
            [
                [
                    c.get("type", ""),
                    c.get("status", ""),
                    c.get("reason", ""),
                    age(c.get("lastTransitionTime"), now),
                    c.get("message", ""),
                ]
                for c in conds
            ],
        )
        if conds
        else "<none>\n"
    )
    out += ["Children:"]
    rows = []
    for c in sorted(children, key=lambda c: (c.get("kind", ""), c["metadata"]["name"])):
        health = _ready(c) if c.get("kind") in ("Deployment", "LeaderWorkerSet") else "-"
        rows.append([f"{c.get('kind')}/{c['metadata']['name']}", health])
    out += _indent(table(["OBJECT", "READY"], rows) if rows else "<none>\n")
    out += ["Pods:"]
    prow = []
    for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
        labels = p["metadata"].get("labels") or {}
        restarts = sum(
            int(s.get("restartCount", 0))
            for s in (p.get("status") or {}).get("containerStatuses") or []
        )
        prow.append([
            p["metadata"]["name"], labels.get(COMPONENT_LABEL, ""), _role(labels),
            "True" if pod_ready(p) else "False", str(restarts),
            (p.get("status") or {}).get("podIP", "<none>"),
        ])  # fmt: skip
    out += _indent(
        table(["NAME", "COMPONENT", "ROLE", "READY", "RESTARTS", "IP"], prow)
        if prow
        else "<none>\n"
    )
    out += ["Events:"]
    recent = sorted(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    erow = [
        [e.get("type", ""), e.get("reason", ""),
         age(e.get("lastTimestamp") or e.get("firstTimestamp"), now), e.get("message", "")]
        for e in recent[-15:]
    ]  # fmt: skip
    out += _indent(table(["TYPE", "REASON", "AGE", "MESSAGE"], erow) if erow else "<none>\n")
    return "\n".join(out) + "\n"


def warm_line(scaling: Json, status: Json) -> list[str]:
    """The warm spares the spec asks for against those decided, and why fewer: warm replicas
    count inside maxReplicas, so at the maximum there is no spare."""
    want = int(scaling.get("warmReplicas") or 0)
    decision = status.get("autoscaling") or {}
    if not want or "desiredWarm" not in decision:
        return []
    warm, active = int(decision["desiredWarm"]), int(decision.get("desiredActive") or 0)
    top = int(scaling.get("maxReplicas") or 0)
    line = f"Warm spares: {warm} of {want}"
    if warm >= want:
        return [line]
    if active + want > top:
        why = f"at maxReplicas ({active} active of {top}; warm replicas count inside it)"
    elif "while demand falls" in str(decision.get("reason") or ""):
        why = "demand falls clearly (warmPool: auto sheds the spare)"
    else:
        why = "see the last scaling decision"
    return [f"{line}: {why}"]


def _indent(text: str) -> list[str]:
    return ["  " + line for line in text.rstrip("\n").split("\n")]


def prefixed(pod: str, text: str) -> str:
    """Log lines prefixed by their pod, as `kubectl logs --prefix` prints them."""
    return "".join(f"[pod/{pod}] {line}\n" for line in text.splitlines())
