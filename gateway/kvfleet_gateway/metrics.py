"""The gateway's Prometheus metrics: per tenant and model, client-side latencies and cost.

Latencies are measured where the user feels them: from the gateway receiving the request
to the first token byte it writes (TTFT), between token chunks (inter-token), to the end.
Cost per request attributes replica time from the tokens the engine reports (see `cost`).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvfleet_gateway.config import CostConfig, Price
from kvfleet_gateway.limiter import COST_UNIT, BudgetState
from kvfleet_kernel.sglang_metrics import (
    BUDGET_REMAINING,
    BUDGET_REMAINING_COST,
    BUDGET_RESERVED,
    COST,
    GATEWAY_PREFIX,
    HELD_REQUESTS,
    ITL,
    QUEUED_REQUESTS,
    REPLICA_THROUGHPUT,
    REQUESTS,
    TOKENS,
    TTFT,
)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)
GPU_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def gpu_seconds(usage: Usage, cost: CostConfig) -> float:
    """Replica time a request used, times the replica's GPUs.

    Prefill of uncached prompt tokens and decoding of output tokens each take a share of the
    replica's throughput at its working point; cached tokens cost (almost) nothing.
    """
    uncached = max(0, usage.prompt_tokens - usage.cached_tokens)
    replica_s = (
        uncached / cost.prefill_tokens_per_second
        + usage.completion_tokens / cost.decode_tokens_per_second
    )
    return replica_s * cost.gpus_per_replica


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        tm = ("tenant", "model")
        p = GATEWAY_PREFIX
        self.requests = Counter(
            REQUESTS, "Requests by final HTTP status.", (*tm, "status"), registry=r
        )
        self.ttft = Histogram(
            TTFT,
            "Client-side time to first token.",
            tm,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            ITL,
            "Client-side time between streamed chunks.",
            tm,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{p}e2e_request_latency_seconds",
            "Client-side request latency.",
            tm,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(TOKENS, "Tokens reported by the engine.", (*tm, "kind"), registry=r)
        self.rejections = Counter(
            f"{p}rejections",
            "Requests refused before reaching an engine.",
            ("tenant", "reason"),
            registry=r,
        )
        self.budget_remaining = Gauge(
            BUDGET_REMAINING,
            "Tokens left in the tenant's token budget this period: the budget less what was"
            " spent (set at each admission and settlement).",
            ("tenant",),
            registry=r,
        )
        self.budget_reserved = Gauge(
            BUDGET_RESERVED,
            "Tokens of the tenant's token budget reserved by requests in flight (each holds"
            " its upper bound until it settles).",
            ("tenant",),
            registry=r,
        )
        self.budget_remaining_cost = Gauge(
            BUDGET_REMAINING_COST,
            "Money left in the tenant's cost budget this period, at the models' prices: the"
            " budget less what was spent (set at each admission and settlement).",
            ("tenant",),
            registry=r,
        )
        self.inflight = Gauge(f"{p}inflight_requests", "Requests in flight.", tm, registry=r)
        self.held = Gauge(
            HELD_REQUESTS,
            "Requests waiting for a replica of their model (none can take them yet).",
            ("model",),
            registry=r,
        )
        self.queued = Gauge(
            QUEUED_REQUESTS,
            "Requests waiting at this gateway because every replica of their model is"
            " saturated (fair queueing under overload).",
            ("model",),
            registry=r,
        )
        self.shed = Counter(
            f"{p}shed_requests",
            "Requests refused under overload, by why: sheddable, queue_full, timeout.",
            ("tenant", "model", "reason"),
            registry=r,
        )
        self.adapters = Gauge(
            f"{p}lora_adapter_loaded",
            "1 for each LoRA adapter a replica's engine holds (its /v1/models, read at every"
            " health probe).",
            ("backend", "adapter"),
            registry=r,
        )
        self.fair_service = Gauge(
            f"{p}fair_share_service",
            "The service a tenant received under fair sharing (weighted prompt and output"
            " tokens over its weight, lifted when it starts waiting): who goes next is the"
            " waiting tenant with the least.",
            ("tenant", "model"),
            registry=r,
        )
        self.upstream_errors = Counter(
            f"{p}upstream_errors", "Failures talking to engines.", ("backend", "kind"), registry=r
        )
        self.usage_clamped = Counter(
            f"{p}usage_clamped",
            "Responses whose engine-reported usage fell outside the admission bound (billed"
            " clamped to it).",
            ("tenant",),
            registry=r,
        )
        self.settlements_pending = Gauge(
            f"{p}settlements_pending",
            "Settlements the shared store has not taken yet (retried in the background).",
            registry=r,
        )
        self.calibrated_prefill = Gauge(
            f"{p}calibrated_prefill_tokens_per_second",
            "The kvfleet policy's learned prefill rate of a replica of the model (its prior"
            " until streamed answers are timed).",
            ("model",),
            registry=r,
        )
        self.calibrated_step = Gauge(
            f"{p}calibrated_decode_step_scale",
            "The kvfleet policy's learned decode step over its configured model (1: as"
            " configured).",
            ("model",),
            registry=r,
        )
        self.replica_throughput = Gauge(
            REPLICA_THROUGHPUT,
            "Requests per second one replica completes at most at the recent request mix"
            " (uncached prompt, output and KV tokens of finished requests) and the calibrated"
            " prefill rate and decode step: a roofline the autoscaler plans from (kvfleet"
            " policy, aggregated serving; absent until 20 requests have finished).",
            ("model",),
            registry=r,
        )
        self.kv_events = Counter(
            f"{p}kv_events",
            "KV-cache events applied to the prefix index, by kind.",
            ("backend", "kind"),
            registry=r,
        )
        self.kv_event_resyncs = Counter(
            f"{p}kv_event_resyncs",
            "Resynchronisations of an engine's KV-event stream (connect, gap, restart), by"
            " outcome: complete (replayed from the first event) or partial (the engine's"
            " replay buffer had rolled over; pages stored before it are unknown).",
            ("backend", "outcome"),
            registry=r,
        )
        self.kv_event_streams = Gauge(
            f"{p}kv_event_streams_live",
            "Engines whose KV-event stream is synchronised (the others route approximately).",
            registry=r,
        )
        self.kv_index_pages = Gauge(
            f"{p}kv_index_pages",
            "Pages each engine holds, as its KV events say.",
            ("backend",),
            registry=r,
        )
        self.gpu_seconds = Histogram(
            f"{p}request_gpu_seconds",
            "GPU-seconds attributed to each request.",
            tm,
            buckets=GPU_SECONDS_BUCKETS,
            registry=r,
        )
        self.cost = Counter(
            COST,
            "Money attributed to requests: at the model's price (per 1M prompt, cached and"
            " output tokens) when it has one, else its GPU time at gpuHourlyPrice.",
            tm,
            registry=r,
        )

    def record_usage(self, tenant: str, model: str, usage: Usage, cost: CostConfig,
                     price: Price | None = None) -> float:  # fmt: skip
        self.tokens.labels(tenant, model, "prompt").inc(usage.prompt_tokens)
        self.tokens.labels(tenant, model, "completion").inc(usage.completion_tokens)
        self.tokens.labels(tenant, model, "cached").inc(usage.cached_tokens)
        gs = gpu_seconds(usage, cost)
        self.gpu_seconds.labels(tenant, model).observe(gs)
        if price is not None:
            money = price.cost(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
        else:
            money = gs * cost.gpu_hourly_price / 3600
        self.cost.labels(tenant, model).inc(money)
        return gs

    def set_budget(self, tenant: str, state: BudgetState) -> None:
        if state.unit == "cost":
            self.budget_remaining_cost.labels(tenant).set(state.left * COST_UNIT)
            return
        self.budget_remaining.labels(tenant).set(state.left)
        self.budget_reserved.labels(tenant).set(state.reserved)
