"""The live check of `kvfleet bench pd`: the real sglang-router in PD mode and kvfleet's
gateway in front of the same simulator engines (two prefill, two decode, processes), asked
the same kind of requests in turn — alternating, so both see the same engine load — and
timed from the client: time to the first streamed token.

Two engines per pool so that the choice matters: the prompts share a few long prefixes (a
document or system prompt each, popularity skewed), so a front end that sends a prefix back
to the prefill engine holding it computes a tenth of the prompt; each decode engine takes
whole streams. The prefill engines listen on their own loopback addresses with one bootstrap
port, as pods do on their own IPs."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvfleet_bench.common import kvfleet_gateway
from kvfleet_sim.procs import free_port, running_process, sglang_router_process, sim_serve_argv

REQUESTS = 150
"""Per front end."""
RATE = 10.0
"""Requests per second offered in all (both front ends together)."""
PREFIX_WORDS, SUFFIX_WORDS, PREFIXES, OUTPUT_TOKENS = 1400, 150, 8, 32
PREFILLS, DECODES = ("127.0.0.2", "127.0.0.3"), 2


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
    prefixes = [" ".join(rng.choice(words) for _ in range(PREFIX_WORDS)) for _ in range(PREFIXES)]
    weights = [1 / (k + 1) for k in range(PREFIXES)]  # Zipf: the first prefix the most asked
    out: dict[str, list[float]] = {"kvfleet": [], "sglang-router": []}
    tasks = []
    async with aiohttp.ClientSession() as s:
        for i in range(2 * REQUESTS):
            (prefix,) = rng.choices(prefixes, weights)
            prompt = prefix + " " + " ".join(rng.choice(words) for _ in range(SUFFIX_WORDS))
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
    bootstrap, port = free_port(), free_port()
    prefills = [f"http://{host}:{port}" for host in PREFILLS]
    decodes = [f"http://127.0.0.1:{free_port()}" for _ in range(DECODES)]
    engines = [
        *((sim_serve_argv(port, host=host, extra=("--disaggregation-mode", "prefill",
           "--disaggregation-bootstrap-port", str(bootstrap))), url)
          for host, url in zip(PREFILLS, prefills, strict=True)),
        *((sim_serve_argv(int(url.rsplit(":", 1)[1]), extra=("--disaggregation-mode", "decode")),
           url) for url in decodes),
    ]  # fmt: skip
    flags = (*(a for u in prefills for a in ("--prefill", u)), "--bootstrap-port", str(bootstrap))
    with contextlib.ExitStack() as stack:
        for i, (argv, url) in enumerate(engines):
            stack.enter_context(running_process(argv, ready_url=f"{url}/health",
                                                log_path=work / f"engine-{i}.log"))  # fmt: skip
        gateway = stack.enter_context(kvfleet_gateway(decodes, work, extra=flags))
        # The router at its default and best for shared prefixes: cache-aware on both pools.
        router = stack.enter_context(sglang_router_process(
            decodes, work / "router.log", prefills=[(u, bootstrap) for u in prefills],
            policy="cache_aware"))  # fmt: skip
        ttfts = asyncio.run(_alternate(gateway, router, seed))
    out: dict[str, Any] = {"requests": REQUESTS, "rate": RATE, "prefills": len(PREFILLS),
                           "decodes": DECODES}  # fmt: skip
    for name, xs in ttfts.items():
        xs.sort()
        out[name] = {"ttft_p50": xs[len(xs) // 2], "ttft_p99": xs[math.ceil(0.99 * len(xs)) - 1]}
    return out
