"""Reading an engine's /metrics into the signals routing needs (through the kernel's one
reader of SGLang's metrics: counts summed over label sets, ratios averaged)."""

from __future__ import annotations

from kvfleet_gateway.routing import EngineSignals
from kvfleet_kernel.sglang_metrics import read_gauges


def parse_metrics(text: str, age_s: float = 0.0) -> EngineSignals | None:
    g = read_gauges(text)
    if "num_queue_reqs" not in g or "max_total_num_tokens" not in g:
        return None
    return EngineSignals(
        queue_reqs=int(g["num_queue_reqs"]),
        running_reqs=int(g.get("num_running_reqs", 0)),
        token_usage=g.get("token_usage", 0.0),
        max_total_tokens=int(g["max_total_num_tokens"]),
        cache_hit_rate=g.get("cache_hit_rate", 0.0),
        age_s=age_s,
    )
