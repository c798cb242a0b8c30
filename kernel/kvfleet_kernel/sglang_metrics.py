"""SGLang's /metrics, read one way by every part of kvfleet: the gateway (routing signals,
every replica every second), the operator (autoscaling, direct scrape or Prometheus) and the
admin CLI (`kvfleet top`).

SGLang exports its scheduler gauges once per label set (`model_name`, `engine_type`,
`tp_rank`, ... and one per data-parallel rank): counts add up over them, ratios average.
Names are accepted as `sglang:x` (what the engine writes) and `sglang_x` (what some Prometheus
pipelines store). Gateway metric names the operator and the CLI read are declared here too,
next to the gateway's own declaration of them (`kvfleet_gateway.metrics`).
"""

from __future__ import annotations

from typing import Literal

Combine = Literal["sum", "avg"]

GAUGES: dict[str, Combine] = {
    "num_queue_reqs": "sum",
    "num_running_reqs": "sum",
    "num_used_tokens": "sum",
    "max_total_num_tokens": "sum",
    "gen_throughput": "sum",
    "token_usage": "avg",
    "cache_hit_rate": "avg",
    "utilization": "avg",
}
"""SGLang's gauges kvfleet reads, and how samples over several label sets combine."""

GATEWAY_PREFIX = "kvfleet_gateway_"
HELD_REQUESTS = f"{GATEWAY_PREFIX}held_requests"
"""Requests a gateway holds for a service with no ready replica (scale from zero)."""
QUEUED_REQUESTS = f"{GATEWAY_PREFIX}queued_requests"
"""Requests a gateway queues because every replica is saturated (fair sharing): demand too."""
COST = f"{GATEWAY_PREFIX}cost"
TOKENS = f"{GATEWAY_PREFIX}tokens"
REQUESTS = f"{GATEWAY_PREFIX}requests"
"""Requests answered (a counter, by final status): with `INFLIGHT`, the arrivals."""
INFLIGHT = f"{GATEWAY_PREFIX}inflight_requests"
REPLICA_THROUGHPUT = f"{GATEWAY_PREFIX}replica_throughput_requests_per_second"
"""Requests per second one replica completes at most at the recent request mix (a gateway's
roofline): where the autoscaler's capacity starts."""
TTFT = f"{GATEWAY_PREFIX}time_to_first_token_seconds"
"""The client-side TTFT histogram: what a TTFT objective is judged on."""
ITL = f"{GATEWAY_PREFIX}inter_token_latency_seconds"
"""The client-side histogram of time between streamed chunks: what an inter-token latency
objective is judged on (a disaggregated service's decode pool sets it)."""
BUDGET_REMAINING = f"{GATEWAY_PREFIX}budget_remaining_tokens"
BUDGET_RESERVED = f"{GATEWAY_PREFIX}budget_reserved_tokens"
BUDGET_REMAINING_COST = f"{GATEWAY_PREFIX}budget_remaining_cost"
"""A cost budget's remainder, in the models' price currency."""


def read_gauges(text: str) -> dict[str, float]:
    """The gauges of `GAUGES` in one engine's exposition text, combined over label sets.

    A line filter, not a full exposition parser: the gateway calls it for every replica every
    second. A gauge the text lacks is absent from the result."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith(("sglang:", "sglang_")):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i > 0), default=-1)
        name = line[7:name_end] if name_end > 0 else ""
        if name not in GAUGES:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1
    return {
        name: total / counts[name] if GAUGES[name] == "avg" else total
        for name, total in sums.items()
    }


def selector(name: str, matchers: str = "") -> str:
    """A PromQL selector of an SGLang series under either spelling of its name."""
    extra = f", {matchers}" if matchers else ""
    return f'{{__name__=~"sglang[:_]{name}"{extra}}}'


def promql(name: str, by: str, matchers: str = "") -> str:
    """The per-`by` value of a gauge in PromQL, combined as `read_gauges` combines it."""
    return f"{GAUGES[name]} by ({by}) ({selector(name, matchers)})"
