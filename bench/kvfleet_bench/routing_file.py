"""`kvfleet bench routing --workload-file W.yaml`: inference-perf's config replayed in the fleet
simulator, every policy over the same stages, each stage a cell of the report (its load is the
stage's rate in requests/s)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from kvfleet_bench.routing_cells import Cell
from kvfleet_sim.fleet.collector import Collector
from kvfleet_sim.fleet.model import FleetConfig
from kvfleet_sim.fleet.routing import KvfleetTuning, routed_fleet
from kvfleet_sim.fleet.workload_file import WorkloadFile
from kvfleet_sim.fleet.workloads import Workload


def staged_cells(
    config: FleetConfig,
    wf: WorkloadFile,
    policies: Sequence[str],
    tuning: KvfleetTuning,
    log: Callable[[str], None],
) -> list[Cell]:
    cells: list[Cell] = []
    vocab = config.engine.model.vocab_size
    for policy in policies:
        sim = routed_fleet(config, policy, tuning)
        result = sim.run(Workload(wf.spec, wf.arrivals, vocab))
        for stage in wf.arrivals.stages:
            records = [r for r in result.records if stage.start_s <= r.arrival <= stage.end_s]
            refused = [r for r in result.refused if stage.start_s <= r.arrival <= stage.end_s]
            if not records and not refused:
                continue
            # Per stage, balance is judged on the tokens each replica served.
            served: dict[int, float] = defaultdict(float)
            for r in records:
                served[r.replica] += r.prompt_tokens - r.cached_tokens + r.output_tokens
            busy = [served.get(i, 0.0) for i in range(config.replicas)]
            s = Collector(records, refused=refused).summary(busy, 0.0, 0)
            cell = Cell.of(wf.name, stage.rate, policy, s)
            cells.append(cell)
            log(
                f"  {stage.rate:g} req/s {policy:19s} {cell.output_throughput:8,.0f} tok/s  "
                f"TTFT p50 {cell.ttft_p50 * 1000:7.1f} ms p90 {cell.ttft_p90 * 1000:8.1f} ms  "
                f"hit {cell.cache_hit_rate:.2f}"
                + (f"  refused {cell.refused} ({s.refusal})" if cell.refused else "")
            )
    return cells
