"""One cell of the routing report: a policy on a workload at a load, as simulated — the mean
over seeds, with the spread the checks must clear."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean

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
    seeds: int = 1
    output_throughput_min: float = 0.0
    output_throughput_max: float = 0.0
    ttft_p90_min: float = 0.0
    ttft_p90_max: float = 0.0
    ttft_p99_min: float = 0.0
    ttft_p99_max: float = 0.0
    refused: int = 0
    """Requests the engines refused (400 or 503, as SGLang answers them): never run."""

    @staticmethod
    def of(workload: str, load: float, policy: str, s: FleetSummary) -> Cell:
        return Cell(
            workload, load, policy, s.output_throughput, s.ttft_p50, s.ttft_p90, s.ttft_p99,
            s.cache_hit_rate, s.imbalance, s.requests, 1,
            s.output_throughput, s.output_throughput, s.ttft_p90, s.ttft_p90,
            s.ttft_p99, s.ttft_p99, s.refused,
        )  # fmt: skip

    @staticmethod
    def merge(runs: Sequence[Cell]) -> Cell:
        """The cell over several seeds: means, and the range of what the checks compare."""
        first = runs[0]

        def mean(attr: str) -> float:
            return fmean(getattr(c, attr) for c in runs)

        return Cell(
            first.workload, first.load, first.policy, mean("output_throughput"),
            mean("ttft_p50"), mean("ttft_p90"), mean("ttft_p99"), mean("cache_hit_rate"),
            mean("imbalance"), sum(c.requests for c in runs), len(runs),
            min(c.output_throughput for c in runs), max(c.output_throughput for c in runs),
            min(c.ttft_p90 for c in runs), max(c.ttft_p90 for c in runs),
            min(c.ttft_p99 for c in runs), max(c.ttft_p99 for c in runs),
            sum(c.refused for c in runs),
        )  # fmt: skip


def merge_seeds(cells: Sequence[Cell]) -> list[Cell]:
    """One cell per (workload, load, policy), in first-seen order."""
    groups: dict[tuple[str, float, str], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.workload, c.load, c.policy), []).append(c)
    return [Cell.merge(runs) for runs in groups.values()]
