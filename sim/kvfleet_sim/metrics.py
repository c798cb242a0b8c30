"""SGLang's Prometheus metrics, with the real names, types, labels and buckets.

Gauges are read from the engine at scrape time (a custom collector); counters and
histograms are fed by a step listener. One `CollectorRegistry` per server, never the
process-global one, so several simulated engines can live in one process.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet_sim.engine import Engine, Step
from kvfleet_sim.request import Request
from kvfleet_sim.scheduler import StepOutcome

LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank")

# Bucket boundaries as in sglang/srt/metrics/collector.py.
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.010,
    0.015,
    0.020,
    0.025,
    0.030,
    0.035,
    0.040,
    0.060,
    0.080,
    0.100,
    0.200,
    0.400,
    0.600,
    0.800,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 800)
QUEUE_BUCKETS = (
    0.0,
    0.1,
    0.2,
    0.5,
    1,
    2,
    3,
    4,
    5,
    10,
    15,
    20,
    30,
    40,
    50,
    60,
    70,
    80,
    90,
    100,
    200,
    300,
    400,
    500,
    600,
    700,
    800,
    900,
    1000,
)


class _GaugeCollector(Collector):
    def __init__(self, engine: Engine, labels: dict[str, str]) -> None:
        self.engine = engine
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        load = self.engine.load()
        values = {
            "num_running_reqs": ("Number of running requests.", load.num_running_reqs),
            "num_queue_reqs": ("Number of requests in the waiting queue.", load.num_waiting_reqs),
            "num_used_tokens": ("Number of used KV tokens.", load.num_used_tokens),
            "token_usage": ("Used KV tokens / KV pool size.", load.token_usage),
            "cache_hit_rate": ("Prefix cache hit rate of the last prefill.", load.cache_hit_rate),
            "gen_throughput": ("Generation throughput (token/s).", load.gen_throughput),
            "max_total_num_tokens": ("KV pool size in tokens.", load.max_total_num_tokens),
            "num_retracted_reqs": ("Requests retracted and waiting.", load.num_retracted_reqs),
            "utilization": ("Share of the binding resource in use.", load.utilization),
        }
        for name, (doc, value) in values.items():
            g = GaugeMetricFamily(f"sglang:{name}", doc, labels=list(self.labels))
            g.add_metric(list(self.labels.values()), float(value))
            yield g


class EngineMetrics:
    def __init__(self, engine: Engine, served_model_name: str, tp_size: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        values = {
            "model_name": served_model_name,
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
        }
        self.registry.register(_GaugeCollector(engine, values))
        lv = list(values.values())
        reg = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"sglang:{name}", doc, LABELS, registry=reg)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"sglang:{name}", doc, LABELS, buckets=buckets, registry=reg)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.").labels(
            *lv
        )
        self.generation_tokens = counter(
            "generation_tokens", "Number of generation tokens processed."
        ).labels(*lv)
        self.cached_tokens = counter("cached_tokens", "Number of cached prompt tokens.").labels(*lv)
        self.num_requests = counter("num_requests", "Number of requests processed.").labels(*lv)
        self.num_aborted = counter("num_aborted_requests", "Number of aborted requests.").labels(
            *lv
        )
        self.ttft = hist(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        ).labels(*lv)
        self.itl = hist(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        ).labels(*lv)
        self.e2e = hist(
            "e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            E2E_BUCKETS,
        ).labels(*lv)
        self.queue_time = hist(
            "queue_time_seconds", "Histogram of queueing time in seconds.", QUEUE_BUCKETS
        ).labels(*lv)
        engine.listeners.append(self.on_step)
        engine.aborted_listeners.append(self.on_abort)

    def on_step(self, engine: Engine, step: Step, outcome: StepOutcome) -> None:
        batch = outcome.batch
        if batch.is_prefill:
            self.prompt_tokens.inc(batch.shape.prefill_tokens + batch.cached_tokens)
            if batch.cached_tokens:
                self.cached_tokens.inc(batch.cached_tokens)
        if outcome.emitted:
            self.generation_tokens.inc(len(outcome.emitted))
        for req in outcome.first_tokens:
            assert req.first_token_time is not None
            self.ttft.observe(req.first_token_time - req.arrival_time)
            if req.scheduled_time is not None:
                self.queue_time.observe(req.scheduled_time - req.arrival_time)
        if not batch.is_prefill:
            for _ in outcome.emitted:
                self.itl.observe(step.duration)
        for req in outcome.finished:
            assert req.finish_time is not None
            self.e2e.observe(req.finish_time - req.arrival_time)
            self.num_requests.inc()

    def on_abort(self, req: Request) -> None:
        self.num_aborted.inc()
