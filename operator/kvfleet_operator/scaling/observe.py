"""Reading the autoscaler's signals: from Prometheus, or straight from the pods' /metrics.

Both readers return the same `Observation` (per engine pod: queue, running, KV usage and
the sample's time; per service: the gateway's held requests and TTFT p99), and
`signals_for` turns it into the policy's `Signals` for one service, knowing which pods are
active and ready. Prometheus is asked a handful of queries per tick for every service at
once, grouped by the labels the rendered PodMonitor attaches (`namespace`, `pod`,
`inferenceservice`, `role`); metric names are matched as `sglang:x` and `sglang_x`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

import aiohttp
from prometheus_api_client import PrometheusConnect
from prometheus_client.parser import text_string_to_metric_families
from urllib3.util.retry import Retry

from kvfleet_kernel.schema import Json
from kvfleet_kernel.sglang_metrics import (
    COST,
    HELD_REQUESTS,
    INFLIGHT,
    ITL,
    QUEUED_REQUESTS,
    REPLICA_THROUGHPUT,
    REQUESTS,
    TOKENS,
    TTFT,
    promql,
    read_gauges,
    selector,
)
from kvfleet_operator.render.common import ENGINE_PORT, GATEWAY_METRICS_PORT, ROLE_LABEL
from kvfleet_operator.scaling.model import ReplicaSignals, Signals
from kvfleet_operator.status import pod_ready

Key = tuple[str, str]
"""(namespace, name)"""


@dataclass(frozen=True)
class PodMetrics:
    queue: float
    running: float
    kv_usage: float
    at: float
    """Unix time of the sample."""


@dataclass(frozen=True)
class Observation:
    source: str
    pods: dict[Key, PodMetrics] = field(default_factory=dict)
    """(namespace, pod) → engine gauges."""
    held: dict[Key, float] = field(default_factory=dict)
    """(namespace, InferenceService) → requests waiting at its gateways (held or queued)."""
    ttft_p99: dict[Key, float] = field(default_factory=dict)
    cost_per_1k_tokens: dict[Key, float] = field(default_factory=dict)
    """(namespace, InferenceService) → money per 1,000 tokens billed (prompt + completion):
    over the last 5 minutes from Prometheus; since the gateway pods started when scraped."""
    arrival_rate: dict[Key, float] = field(default_factory=dict)
    """(namespace, InferenceService) → requests per second arriving at its gateways
    (Prometheus: answered plus the change in flight, over a minute)."""
    arrivals_total: dict[Key, float] = field(default_factory=dict)
    """Direct scrape: requests answered plus in flight, summed over the gateway pods (a
    counter whose difference between ticks is the arrivals)."""
    slo_ttft: dict[Key, float] = field(default_factory=dict)
    """Prometheus: the gateways' TTFT at the service's SLO quantile over the last minute."""
    ttft_buckets: dict[Key, dict[float, float]] = field(default_factory=dict)
    """Direct scrape: the gateways' cumulative TTFT histogram (upper bound → count)."""
    slo_itl: dict[Key, float] = field(default_factory=dict)
    """Prometheus: the gateways' inter-token latency at the SLO quantile over the last minute."""
    itl_buckets: dict[Key, dict[float, float]] = field(default_factory=dict)
    """Direct scrape: the gateways' cumulative inter-token latency histogram."""
    replica_throughput: dict[Key, float] = field(default_factory=dict)
    """(namespace, InferenceService) → requests per second one replica completes at most at
    the recent request mix, as its gateways estimate it (their mean)."""
    error: str | None = None


@dataclass(frozen=True)
class ServicePods:
    """One autoscaled service as the autoscaler reads it."""

    namespace: str
    name: str
    engines: list[Json]
    gateways: list[Json]
    ttft_quantile: float = 0.99
    """The quantile of TTFT its SLO is judged on (`slo.attainment`)."""
    prefills: list[Json] = field(default_factory=list)
    """A disaggregated service's prefill engine pods."""

    def prefill_pool(self) -> ServicePods:
        """The prefill pool as a service of its own (its gateways are the service's, read
        once with the engines)."""
        return ServicePods(self.namespace, self.name, self.prefills, [], self.ttft_quantile)


@dataclass(frozen=True)
class Demand:
    """One service's demand and latency over the last tick, as the gateways saw them."""

    arrival_rate: float | None = None
    """Requests per second arriving."""
    ttft: float | None = None
    """TTFT at the SLO's quantile, seconds."""
    itl: float | None = None
    """Inter-token latency (between streamed chunks) at the SLO's quantile, seconds."""
    replica_throughput: float | None = None
    """Requests per second one replica completes at most at the recent request mix."""


def ready_since(pod: Json) -> float | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready" and c.get("status") == "True" and c.get("lastTransitionTime"):
            return parse_time(c["lastTransitionTime"])
    return None


def parse_time(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def role_of(pod: Json) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(ROLE_LABEL)


def signals_for(
    svc: ServicePods,
    obs: Observation,
    now: float,
    stale_s: float,
    grace_s: float,
    demand: Demand = Demand(),
) -> Signals:
    """The policy's view of one service: fresh metrics of its active ready pods (the ones
    without fresh data named as missing), and `demand`: its arrival rate and the latencies
    its SLO is judged on, as the autoscaler derived them."""
    if obs.error is not None:
        return Signals(error=obs.error)
    replicas, missing = [], []
    for pod in svc.engines:
        if not pod_ready(pod) or role_of(pod) != "active":
            continue
        name = pod["metadata"]["name"]
        m = obs.pods.get((svc.namespace, name))
        since = ready_since(pod)
        young = since is not None and now - since < grace_s
        if m is None or now - m.at > stale_s:
            if not young:  # a replica that just turned ready may not be scraped yet
                missing.append(name)
            continue
        replicas.append(ReplicaSignals(name, m.queue, m.running, m.kv_usage, young=young))
    held = obs.held.get((svc.namespace, svc.name), 0.0)
    return Signals(tuple(replicas), tuple(missing), held, arrival_rate=demand.arrival_rate,
                   ttft=demand.ttft, itl=demand.itl,
                   replica_throughput=demand.replica_throughput)  # fmt: skip


# ---- Prometheus ---------------------------------------------------------------------------------
SERVED = 'inferenceservice!=""'
"""Series the PodMonitor labelled as an InferenceService's."""


class PrometheusReader:
    """A few queries per tick, for every service at once."""

    def __init__(
        self, url: str, timeout_s: float = 5.0, verify_tls: bool = True, rate_window: str = "1m"
    ) -> None:
        self.url = url
        # The HTTP read is bounded too (a second past the query's own timeout): a Prometheus
        # that accepts and never answers must not hold the autoscaler.
        # No retries within a tick either: the next tick is the retry.
        self.prom = PrometheusConnect(
            url=url,
            disable_ssl=not verify_tls,
            timeout=math.ceil(timeout_s) + 1,
            retry=Retry(total=0),
        )
        self.timeout_s = timeout_s
        self.rate_window = rate_window

    def _vector(self, query: str, labels: Sequence[str]) -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = {}
        for sample in self.prom.custom_query(query, params={"timeout": f"{self.timeout_s:g}s"}):
            metric = sample.get("metric") or {}
            value = float(sample["value"][1])
            if all(label in metric for label in labels) and not math.isnan(value):
                out[tuple(metric[label] for label in labels)] = value
        return out

    def read_sync(self, services: Sequence[ServicePods] = ()) -> Observation:
        pod = ("namespace", "pod")
        svc = ("namespace", "inferenceservice")
        try:
            by = "namespace, pod"
            queue = self._vector(promql("num_queue_reqs", by, SERVED), pod)
            running = self._vector(promql("num_running_reqs", by, SERVED), pod)
            usage = self._vector(promql("token_usage", by, SERVED), pod)
            at = self._vector(
                f"max by ({by}) (timestamp({selector('num_queue_reqs', SERVED)}))", pod
            )
            # Held (no replica yet) and queued (every replica saturated): demand waiting.
            waiting = f'{{__name__=~"{HELD_REQUESTS}|{QUEUED_REQUESTS}"}}'
            held = self._vector(f"sum by (namespace, inferenceservice) ({waiting})", svc)
            ttft = self._vector(
                "histogram_quantile(0.99, sum by (namespace, inferenceservice, le) "
                f"(rate({selector('time_to_first_token_seconds_bucket', SERVED)}[5m])))",
                svc,
            )
            cost = self._vector(
                f"1000 * sum by (namespace, inferenceservice) (rate({COST}_total[5m]))"
                " / sum by (namespace, inferenceservice)"
                f' (rate({TOKENS}_total{{kind!="cached"}}[5m]))',  # cached ⊂ prompt
                svc,
            )
            by_svc = "namespace, inferenceservice"
            arrivals = self._vector(
                f"sum by ({by_svc}) (rate({REQUESTS}_total[{self.rate_window}]))"
                f" + sum by ({by_svc}) (deriv({INFLIGHT}[{self.rate_window}]))",
                svc,
            )
            throughput = self._vector(f"avg by ({by_svc}) ({REPLICA_THROUGHPUT})", svc)
            slo = self._at_slo_quantile(TTFT, services)
            slo_itl = self._at_slo_quantile(ITL, services)
        except Exception as exc:  # any failure of the reader: the policy holds and says why
            return Observation("prometheus", error=f"Prometheus at {self.url}: {exc}"[:300])
        pods = {
            k: PodMetrics(queue[k], running.get(k, 0.0), usage.get(k, 0.0), at.get(k, 0.0))
            for k in queue
        }
        return Observation(
            "prometheus",
            {(a, b): v for (a, b), v in pods.items()},
            {(a, b): v for (a, b), v in held.items()},
            {(a, b): v for (a, b), v in ttft.items()},
            {(a, b): v for (a, b), v in cost.items() if math.isfinite(v)},
            arrival_rate={(a, b): max(0.0, v) for (a, b), v in arrivals.items()},
            slo_ttft={(a, b): v for (a, b), v in slo.items() if math.isfinite(v)},
            slo_itl={(a, b): v for (a, b), v in slo_itl.items() if math.isfinite(v)},
            replica_throughput={(a, b): v for (a, b), v in throughput.items() if v > 0},
        )

    def _at_slo_quantile(
        self, histogram: str, services: Sequence[ServicePods]
    ) -> dict[tuple[str, ...], float]:
        """The gateways' `histogram` at each service's SLO quantile (one query per quantile)."""
        by_svc = "namespace, inferenceservice"
        out: dict[tuple[str, ...], float] = {}
        for q in sorted({s.ttft_quantile for s in services}):
            found = self._vector(
                f"histogram_quantile({q:g}, sum by ({by_svc}, le)"
                f" (rate({histogram}_bucket[{self.rate_window}])))",
                ("namespace", "inferenceservice"),
            )
            wanted = {(s.namespace, s.name) for s in services if s.ttft_quantile == q}
            out.update({k: v for k, v in found.items() if k in wanted})
        return out

    async def read(self, services: Sequence[ServicePods]) -> Observation:
        return await asyncio.to_thread(self.read_sync, services)


# ---- direct scrape ------------------------------------------------------------------------------
def parse_engine(text: str, at: float) -> PodMetrics | None:
    g = read_gauges(text)
    if "num_queue_reqs" not in g:
        return None
    return PodMetrics(
        g["num_queue_reqs"], g.get("num_running_reqs", 0.0), g.get("token_usage", 0.0), at
    )


@dataclass(frozen=True)
class GatewayTotals:
    held: float = 0.0
    cost: float = 0.0
    tokens: float = 0.0
    arrivals: float = 0.0
    """Requests answered plus in flight: a counter of arrivals."""
    ttft: tuple[tuple[float, float], ...] = ()
    """The TTFT histogram's cumulative buckets (upper bound, count)."""
    itl: tuple[tuple[float, float], ...] = ()
    """The inter-token latency histogram's cumulative buckets."""
    throughput: tuple[float, ...] = ()
    """Each gateway's estimate of one replica's throughput (requests per second)."""

    def __add__(self, other: GatewayTotals) -> GatewayTotals:
        return GatewayTotals(
            self.held + other.held,
            self.cost + other.cost,
            self.tokens + other.tokens,
            self.arrivals + other.arrivals,
            _summed(self.ttft, other.ttft),
            _summed(self.itl, other.itl),
            self.throughput + other.throughput,
        )


def _summed(
    a: tuple[tuple[float, float], ...], b: tuple[tuple[float, float], ...]
) -> tuple[tuple[float, float], ...]:
    buckets = dict(a)
    for le, n in b:
        buckets[le] = buckets.get(le, 0.0) + n
    return tuple(sorted(buckets.items()))


def parse_gateway(text: str) -> GatewayTotals:
    """A gateway pod's held requests, its lifetime cost, billed tokens and arrivals, its
    TTFT and inter-token latency histograms, and its estimate of a replica's throughput."""
    held = cost = tokens = arrivals = 0.0
    throughput: list[float] = []
    histograms: dict[str, dict[float, float]] = {TTFT: {}, ITL: {}}
    for family in text_string_to_metric_families(text):
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        # cached tokens are counted among the prompt's already
        total = sum(s.value for s in samples if s.labels.get("kind") != "cached")
        if family.name in (HELD_REQUESTS, QUEUED_REQUESTS):  # waiting at the gateway
            held += total
        elif family.name == COST:
            cost += total
        elif family.name == TOKENS:
            tokens += total
        elif family.name in (REQUESTS, f"{REQUESTS}_total", INFLIGHT):
            arrivals += total
        elif family.name == REPLICA_THROUGHPUT:
            throughput.extend(s.value for s in samples if s.value > 0)
        elif family.name in histograms:
            buckets = histograms[family.name]
            for s in samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
    ttft, itl = (tuple(sorted(histograms[h].items())) for h in (TTFT, ITL))
    return GatewayTotals(held, cost, tokens, arrivals, ttft, itl, tuple(throughput))


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """`q` of a histogram's cumulative buckets, interpolated within a bucket as Prometheus's
    histogram_quantile does (None: no observations)."""
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank, prev_le, prev_n = q * ordered[-1][1], 0.0, 0.0
    for le, n in ordered:
        if n >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_n) / max(n - prev_n, 1e-12)
        prev_le, prev_n = le, n
    return prev_le


def _pod_url(pod: Json, port: int) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{port}/metrics" if ip and pod_ready(pod) else None


class DirectReader:
    """No Prometheus: every ready engine pod's and gateway pod's /metrics, read concurrently.
    The operator must then reach the pods (the rendered NetworkPolicy admits it)."""

    source = "direct"

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _get(self, session: aiohttp.ClientSession, url: str) -> str | None:
        try:
            async with session.get(url) as r:
                return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def read(self, services: Sequence[ServicePods]) -> Observation:
        jobs: list[tuple[str, Key, str]] = []
        for svc in services:
            for pod in svc.engines:
                url = _pod_url(pod, ENGINE_PORT)
                if url:
                    jobs.append(("engine", (svc.namespace, pod["metadata"]["name"]), url))
            for pod in svc.gateways:
                url = _pod_url(pod, GATEWAY_METRICS_PORT)
                if url:
                    jobs.append(("gateway", (svc.namespace, svc.name), url))
        async with aiohttp.ClientSession(timeout=self.timeout) as session:
            texts = await asyncio.gather(*(self._get(session, url) for _, _, url in jobs))
        now = time.time()
        obs = Observation("direct")
        gateways: dict[Key, GatewayTotals] = {}
        for (kind, key, _), text in zip(jobs, texts, strict=True):
            if text is None:
                continue
            try:
                if kind == "engine":
                    m = parse_engine(text, now)
                    if m is not None:
                        obs.pods[key] = m
                else:
                    gateways[key] = gateways.get(key, GatewayTotals()) + parse_gateway(text)
            except ValueError:  # an unparsable exposition counts as no data
                continue
        for key, totals in gateways.items():
            obs.held[key] = totals.held
            obs.arrivals_total[key] = totals.arrivals
            obs.ttft_buckets[key] = dict(totals.ttft)
            obs.itl_buckets[key] = dict(totals.itl)
            if totals.throughput:
                obs.replica_throughput[key] = sum(totals.throughput) / len(totals.throughput)
            if totals.tokens > 0:
                obs.cost_per_1k_tokens[key] = 1000 * totals.cost / totals.tokens
        return obs
