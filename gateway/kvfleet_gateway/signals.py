"""Reading an engine's /metrics: the few SGLang gauges routing needs, and nothing else.

A line filter rather than a full exposition parser: it is called for every replica every
second. Names are accepted as `sglang:x` (the engine) and `sglang_x` (as some Prometheus
pipelines rewrite them). Values over several label sets (TP/DP ranks) are summed for counts
and averaged for ratios.
"""

from __future__ import annotations

from kvfleet_gateway.routing import EngineSignals

_WANTED = {
    "num_queue_reqs",
    "num_running_reqs",
    "token_usage",
    "max_total_num_tokens",
    "cache_hit_rate",
}
_RATIOS = {"token_usage", "cache_hit_rate"}


def parse_metrics(text: str, age_s: float = 0.0) -> EngineSignals | None:
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith("sglang"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i > 0), default=-1)
        if name_end < 0:
            continue
        name = line[7:name_end]  # after "sglang:" or "sglang_"
        if name not in _WANTED:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1
    if "num_queue_reqs" not in sums or "max_total_num_tokens" not in sums:
        return None
    for name in _RATIOS & sums.keys():
        sums[name] /= counts[name]
    return EngineSignals(
        queue_reqs=int(sums["num_queue_reqs"]),
        running_reqs=int(sums.get("num_running_reqs", 0)),
        token_usage=sums.get("token_usage", 0.0),
        max_total_tokens=int(sums["max_total_num_tokens"]),
        cache_hit_rate=sums.get("cache_hit_rate", 0.0),
        age_s=age_s,
    )
