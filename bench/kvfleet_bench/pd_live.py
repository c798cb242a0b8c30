"""The live check of `kvfleet bench pd`: the real sglang-router in PD mode and kvfleet's
gateway in front of the same two simulator engines (one prefill, one decode, processes),
asked the same kind of requests in turn — alternating, so both see the same engine load —
and timed from the client: time to the first streamed token."""

from __future__ import annotations

import asyncio
import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvfleet_bench.common import kvfleet_gateway
from kvfleet_sim.procs import free_port, running_process, sglang_router_process, sim_serve_argv

REQUESTS = 80
"""Per front end."""
RATE = 6.0
"""Requests per second offered in all (both front ends together)."""
PROMPT_WORDS, OUTPUT_TOKENS = 1500, 32


async def _ttft(session: aiohttp.ClientSession, url: str, prompt: str) -> float:
    body = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": OUTPUT_TOKENS, "stream": True, "ignore_eos": True}  # fmt: skip
    start = time.monotonic()
    first = math.inf
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {") and b'"content":"' in line and first == math.inf:
                first = time.monotonic() - start
    return first


async def _alternate(kvfleet: str, router: str, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    words = "the of and to in is it you that he was for on are as with his they".split()
    out: dict[str, list[float]] = {"kvfleet": [], "sglang-router": []}
    tasks = []
    async with aiohttp.ClientSession() as s:
        for i in range(2 * REQUESTS):
            prompt = " ".join(rng.choice(words) for _ in range(PROMPT_WORDS))  # no shared prefix
            name, url = ("kvfleet", kvfleet) if i % 2 == 0 else ("sglang-router", router)

            async def one(name: str = name, url: str = url, prompt: str = prompt) -> None:
                out[name].append(await _ttft(s, url, prompt))

            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(rng.expovariate(RATE))
        await asyncio.gather(*tasks)
    return out


def live_check(seed: int = 1) -> dict[str, Any]:
    """TTFT p50/p99 through each front end, same engines, same load."""
    work = Path(tempfile.mkdtemp(prefix="kvfleet-pd-live-"))
    prefill_port, bootstrap, decode_port = free_port(), free_port(), free_port()
    prefill, decode = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
    p_argv = sim_serve_argv(prefill_port, extra=("--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(bootstrap)))  # fmt: skip
    d_argv = sim_serve_argv(decode_port, extra=("--disaggregation-mode", "decode"))
    flags = ("--prefill", prefill, "--bootstrap-port", str(bootstrap))
    with (
        running_process(p_argv, ready_url=f"{prefill}/health", log_path=work / "prefill.log"),
        running_process(d_argv, ready_url=f"{decode}/health", log_path=work / "decode.log"),
        kvfleet_gateway([decode], work, extra=flags) as gateway,
        sglang_router_process(
            [decode], work / "router.log", prefills=[(prefill, bootstrap)], policy="cache_aware"
        ) as router,  # fmt: skip
    ):
        ttfts = asyncio.run(_alternate(gateway, router, seed))
    out: dict[str, Any] = {"requests": REQUESTS, "rate": RATE}
    for name, xs in ttfts.items():
        xs.sort()
        out[name] = {"ttft_p50": xs[len(xs) // 2], "ttft_p99": xs[math.ceil(0.99 * len(xs)) - 1]}
    return out
