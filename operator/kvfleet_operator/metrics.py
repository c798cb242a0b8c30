"""The operator's own metrics (Prometheus text at `--metrics-port`, default 8081):
reconciles and their duration, the work queue, scaling decisions, and what it costs the API
server (requests by verb, reads the watch cache answered instead)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

DEFAULT_PORT = 8081


class _KubeCosts(Collector):
    """Read at scrape time from the client's own counters (no second bookkeeping)."""

    def __init__(self, calls: Callable[[], dict[str, int]], hits: Callable[[], int]) -> None:
        self.calls, self.hits = calls, hits

    def collect(self) -> Iterator[Any]:
        requests = CounterMetricFamily(
            "kvfleet_operator_api_requests",
            "Requests to the API server by HTTP verb.",
            labels=["verb"],
        )
        for verb, n in sorted(self.calls().items()):
            requests.add_metric([verb], n)
        yield requests
        yield CounterMetricFamily(
            "kvfleet_operator_cache_reads",
            "Reads answered by the watch cache instead of the API server.",
            value=self.hits(),
        )


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "kvfleet_operator_"
        self.reconciles = Counter(
            f"{p}reconciles", "Reconciles by result (ok, error).", ["result"], registry=r
        )
        self.reconcile_seconds = Histogram(
            f"{p}reconcile_duration_seconds",
            "Time of one reconcile.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.queue_depth = Gauge(
            f"{p}queue_depth", "InferenceServices waiting to reconcile.", registry=r
        )
        self.services = Gauge(f"{p}inferenceservices", "InferenceServices watched.", registry=r)
        self.scaling_decisions = Counter(
            f"{p}scaling_decisions",
            "Autoscaler decisions that changed the fleet, by direction.",
            ["namespace", "inferenceservice", "direction"],
            registry=r,
        )
        self.desired = Gauge(
            f"{p}desired_replicas",
            "The autoscaler's desired replicas by role (active, warm).",
            ["namespace", "inferenceservice", "role"],
            registry=r,
        )

    def watch_kube(self, calls: Callable[[], dict[str, int]], hits: Callable[[], int]) -> None:
        self.registry.register(_KubeCosts(calls, hits))

    def app(self) -> web.Application:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.registry), content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        return app
