"""One cell of the routing report: a policy on a workload at a load, as simulated."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_sim.fleet.collector import FleetSummary


@dataclass(frozen=True)
class Cell:
    workload: str
    load: float
    """A share of the workload's capacity, or (workload files) a stage's requests/s."""
    policy: str
    output_throughput: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    cache_hit_rate: float
    imbalance: float
    requests: int

    @staticmethod
    def of(workload: str, load: float, policy: str, s: FleetSummary) -> Cell:
        return Cell(
            workload,
            load,
            policy,
            s.output_throughput,
            s.ttft_p50,
            s.ttft_p90,
            s.ttft_p99,
            s.cache_hit_rate,
            s.imbalance,
            s.requests,
        )
