"""The routing live check: the same workload over real HTTP through kvfleet's gateway and
through the real sglang-router (cache_aware), one after the other, in front of the same four
real-time simulator engines (their caches flushed in between)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from kvfleet_bench.common import engines, kvfleet_gateway, stream_chat
from kvfleet_sim.fleet.collector import percentile
from kvfleet_sim.procs import sglang_router_process

WORDS = (
    "cache batch token prefix replica queue latency decode prefill kernel memory tensor "
    "router gateway budget tenant stream engine model context window"
).split()


def _workload(n: int, seed: int) -> list[dict[str, Any]]:
    """Hot-tenant chat: one system prompt in half the requests, 15 others share the rest."""
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(350)) for _ in range(16)]
    out = []
    for _ in range(n):
        system = systems[0] if rng.random() < 0.5 else systems[rng.randrange(1, 16)]
        question = " ".join(rng.choice(WORDS) for _ in range(20))
        out.append(
            {
                "model": "llama-3.1-8b",
                "max_tokens": 32,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
            }
        )
    return out


async def _replay(
    url: str, bodies: list[dict[str, Any]], rate: float, seed: int
) -> dict[str, float]:
    rng = random.Random(seed)
    ttft: list[float] = []
    prompt = cached = completion = errors = 0

    async def one(session: aiohttp.ClientSession, body: dict[str, Any]) -> None:
        nonlocal prompt, cached, completion, errors
        out = await stream_chat(session, url, body)
        if out.status != 200:
            errors += 1
            return
        prompt += out.prompt_tokens
        completion += out.completion_tokens
        cached += out.cached_tokens
        if out.ttft is not None:
            ttft.append(out.ttft)

    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(one(session, body)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return {
        "requests": len(ttft),
        "errors": errors,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "cache_hit_rate": cached / prompt if prompt else 0,
        "output_throughput": completion / duration,
    }


def _flush(engines: list[str]) -> None:
    for url in engines:
        for _ in range(100):  # /flush_cache only works once the engine is idle
            req = urllib.request.Request(f"{url}/flush_cache", data=b"", method="POST")
            with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    break
            time.sleep(0.1)


def live_check(
    work: Path, log: Callable[[str], None], requests: int = 300, rate: float = 25.0, seed: int = 3
) -> dict[str, dict[str, float]]:
    bodies = _workload(requests, seed)
    results: dict[str, dict[str, float]] = {}
    with engines(4, work, stream_interval=4, name="live-engine") as urls:
        with kvfleet_gateway(urls, work, policy="kvfleet", log_name="live-gw.log") as gw:
            time.sleep(1.5)  # a first round of /metrics scrapes
            results["kvfleet gateway (kvfleet policy)"] = asyncio.run(
                _replay(gw, bodies, rate, seed)
            )
        _flush(urls)
        with sglang_router_process(urls, work / "live-router.log") as router:
            results["sglang-router 0.3.2 (cache_aware)"] = asyncio.run(
                _replay(router, bodies, rate, seed)
            )
    for name, r in results.items():
        log(
            f"  live, {name}: TTFT p50 {r['ttft_p50'] * 1000:.1f} ms, p99 "
            f"{r['ttft_p99'] * 1000:.1f} ms, cache hits {r['cache_hit_rate']:.2f}, "
            f"{r['output_throughput']:,.0f} output tok/s, {r['errors']:.0f} errors"
        )
    return results


def live_report(results: dict[str, dict[str, float]], requests: int, rate: float) -> str:
    lines = [
        "## Live check over real HTTP",
        "",
        f"{requests} hot-tenant chat requests (one of 16 system prompts in half of them, "
        f"32 output tokens) at {rate:g} req/s, Poisson, against 4 real-time simulator "
        "engines; the same requests and arrival times through each router, engine caches "
        "flushed in between. Client-side measurements.",
        "",
        "| router | TTFT p50 | TTFT p99 | cache hits | output tok/s | errors |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['ttft_p50'] * 1000:.1f} ms | {r['ttft_p99'] * 1000:.1f} ms"
            f" | {r['cache_hit_rate']:.2f} | {r['output_throughput']:,.0f} | "
            f"{r['errors']:.0f} |"
        )
    return "\n".join(lines) + "\n"
