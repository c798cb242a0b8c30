"""Real peers: sglang-router 0.3.2 routes through simulator workers; Prometheus scrapes them."""

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_api_client import PrometheusConnect

from kvfleet_sim.procs import sglang_router_process

pytest.importorskip("sglang_router", reason="sglang-router is a dev dependency (make setup)")


def http_json(url: str, payload: Any | None = None) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_sglang_router_cache_aware_serves_through_two_workers(
    sim_processes: Any, tmp_path: Path
) -> None:
    workers = [sim_processes(), sim_processes()]
    with sglang_router_process(workers, tmp_path / "router.log") as router:
        out = http_json(
            f"{router}/generate",
            {"text": "Hello from the router", "sampling_params": {"max_new_tokens": 5}},
        )
        assert out["meta_info"]["completion_tokens"] == 5
        assert out["text"]
        chat = http_json(
            f"{router}/v1/chat/completions",
            {
                "model": "llama-3.1-8b",
                "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        assert chat["usage"]["completion_tokens"] == 3
        # cache_aware sends the same prompt back to the worker that holds its prefix
        for _ in range(3):
            again = http_json(
                f"{router}/generate",
                {"text": "Hello from the router", "sampling_params": {"max_new_tokens": 5}},
            )
        assert again["meta_info"]["cached_tokens"] > 0


def test_prometheus_scrapes_sglang_metrics(sim_processes: Any, prometheus: Any) -> None:
    worker = sim_processes()
    prom_url = prometheus([worker.removeprefix("http://")])
    http_json(f"{worker}/generate", {"text": "warm up", "sampling_params": {"max_new_tokens": 3}})
    prom = PrometheusConnect(url=prom_url, disable_ssl=True)
    deadline = time.monotonic() + 30
    found: dict[str, Any] = {}
    while time.monotonic() < deadline and len(found) < 3:
        for metric in ("num_queue_reqs", "token_usage", "generation_tokens_total"):
            # A Prometheus server may store the name with ':' or escaped to '_'.
            q = f'{{__name__=~"sglang[:_]{metric}"}}'
            result = prom.custom_query(q)
            if result:
                found[metric] = result[0]
        time.sleep(0.5)
    assert set(found) == {"num_queue_reqs", "token_usage", "generation_tokens_total"}, found
    assert found["num_queue_reqs"]["metric"]["model_name"] == "llama-3.1-8b"
    assert float(found["generation_tokens_total"]["value"][1]) == 3.0
