"""What a fleet run measured: latency distributions, throughput, cache hits, balance, cost."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an unsorted list; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


@dataclass(slots=True)
class RequestRecord:
    arrival: float
    first_token: float
    finish: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    replica: int
    tenant: str

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first."""
        return (self.finish - self.first_token) / max(1, self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class RefusedRecord:
    """A request the engine refused at submission, with SGLang's status and message."""

    arrival: float
    prompt_tokens: int
    status: int
    message: str
    tenant: str


@dataclass(frozen=True)
class FleetSummary:
    requests: int
    duration_s: float
    output_throughput: float
    """Output tokens per second over the run (first arrival to last finish)."""
    request_throughput: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    e2e_p50: float
    e2e_p99: float
    cache_hit_rate: float
    """Cached prompt tokens / prompt tokens, over all requests."""
    imbalance: float
    """1 − mean/max of per-replica busy time: 0 is perfectly even, near 1 is one hot replica."""
    gpu_seconds: float
    """GPUs × seconds each replica existed (the bill, idle time included)."""
    gpu_seconds_per_request: float
    retractions: int
    aborted: int
    refused: int = 0
    """Requests the engine refused (400: longer than the context or the KV pool; 503: queue
    full): answered with an error, never run; not in `requests`."""
    refusal: str = ""
    """The first refusal's status and message, as the client saw it."""

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


class NoRequestFinished(ValueError):
    """The simulated time ended before any request did: there is nothing to summarize."""


@dataclass
class Collector:
    records: list[RequestRecord] = field(default_factory=list)
    aborted: int = 0
    refused: list[RefusedRecord] = field(default_factory=list)

    def add(self, record: RequestRecord) -> None:
        self.records.append(record)

    def refuse(self, record: RefusedRecord) -> None:
        self.refused.append(record)

    def summary(self, busy_s: list[float], gpu_seconds: float, retractions: int) -> FleetSummary:
        rs = self.records
        if not rs and not self.refused:
            raise NoRequestFinished("no request finished")
        start = min((r.arrival for r in rs), default=0.0)
        end = max((r.finish for r in rs), default=0.0)
        duration = max(end - start, 1e-9)
        first = self.refused[0] if self.refused else None
        ttft = [r.ttft for r in rs]
        tpot = [r.tpot for r in rs if r.output_tokens > 1]
        e2e = [r.finish - r.arrival for r in rs]
        prompt = sum(r.prompt_tokens for r in rs)
        peak = max(busy_s) if busy_s else 0.0
        return FleetSummary(
            requests=len(rs),
            duration_s=duration,
            output_throughput=sum(r.output_tokens for r in rs) / duration,
            request_throughput=len(rs) / duration,
            ttft_p50=percentile(ttft, 50),
            ttft_p90=percentile(ttft, 90),
            ttft_p99=percentile(ttft, 99),
            tpot_p50=percentile(tpot, 50),
            tpot_p99=percentile(tpot, 99),
            e2e_p50=percentile(e2e, 50),
            e2e_p99=percentile(e2e, 99),
            cache_hit_rate=sum(r.cached_tokens for r in rs) / prompt if prompt else 0.0,
            imbalance=1 - (sum(busy_s) / len(busy_s)) / peak if peak > 0 else 0.0,
            gpu_seconds=gpu_seconds,
            gpu_seconds_per_request=gpu_seconds / len(rs) if rs else math.nan,
            retractions=retractions,
            aborted=self.aborted,
            refused=len(self.refused),
            refusal="" if first is None else f"{first.status}: {first.message}",
        )
