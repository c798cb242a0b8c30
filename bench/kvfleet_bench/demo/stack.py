"""`kvfleet demo`: the whole stack that exists so far, live on one machine, no GPU, no cluster.

Three SGLang-compatible engines (simulator processes, real time), the kvfleet gateway in
front of them (API keys, per-tenant limits and a token budget, kvfleet routing), and two
tenants' traffic through it: a support chat sharing one system prompt, whose rate spikes
mid-run, and a document-search tenant whose small budget runs out. The table reads the
engines' and the gateway's real /metrics and what the clients saw.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from rich.console import Group
from rich.table import Table

from kvfleet_bench.common import engines, stream_chat
from kvfleet_bench.demo.live import WINDOW_S, live_view
from kvfleet_gateway.keys import hash_key
from kvfleet_gateway.signals import parse_metrics
from kvfleet_sim.fleet.collector import percentile
from kvfleet_sim.procs import free_port, running_process

WORDS = (
    "kv cache prefix replica queue token budget latency router tenant stream decode "
    "prefill engine model gpu batch radix memory request"
).split()
SUPPORT_PROMPT = (
    "You are the support assistant of a GPU cloud. Answer briefly, cite the "
    "runbook section, never invent prices. " * 12
)


@dataclass
class TenantStats:
    sent: int = 0
    ok: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    ttft: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=2000))
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    budget_left: str = "-"


def _configs(
    work: Path, backends: list[str], port: int, metrics_port: int
) -> tuple[Path, dict[str, str]]:
    raw = {
        "support-chat": "kvf-" + secrets.token_urlsafe(16),
        "doc-search": "kvf-" + secrets.token_urlsafe(16),
    }
    keys = {
        "tenants": [
            {
                "name": "support-chat",
                "keys": [hash_key(raw["support-chat"])],
                "limits": {"requestsPerMinute": 3000, "maxConcurrent": 64},
            },
            {
                "name": "doc-search",
                "keys": [hash_key(raw["doc-search"])],
                "limits": {"tokenBudget": {"tokens": 40_000, "period": "1h"}},
            },
        ]
    }
    (work / "keys.yaml").write_text(yaml.safe_dump(keys))
    config = {
        "listen": {"host": "127.0.0.1", "port": port, "metricsPort": metrics_port},
        "backends": {"static": backends},
        "routing": {"policy": "kvfleet"},
        "auth": {"keysFile": str(work / "keys.yaml")},
        "limits": {"store": "memory", "defaults": {"maxTokens": 512, "defaultMaxTokens": 64}},
        "cost": {"gpuHourlyPrice": 3.5},
    }
    path = work / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, raw


async def send_chat(
    session: aiohttp.ClientSession, gw: str, key: str, body: dict[str, Any], stats: TenantStats
) -> None:
    stats.sent += 1
    out = await stream_chat(session, gw, body, {"Authorization": f"Bearer {key}"})
    stats.budget_left = out.headers.get("x-kvfleet-budget-remaining-tokens", stats.budget_left)
    if out.status != 200:
        code = out.error_code or str(out.status)
        stats.rejected[code] = stats.rejected.get(code, 0) + 1
        return
    if out.ttft is not None and out.first_token_at is not None:
        stats.ttft.append((out.first_token_at, out.ttft))
    stats.prompt_tokens += out.prompt_tokens
    stats.completion_tokens += out.completion_tokens
    stats.cached_tokens += out.cached_tokens
    stats.ok += 1


def support_body(rng: random.Random) -> dict[str, Any]:
    question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30)))
    return {
        "model": "llama-3.1-8b",
        "stream": True,
        "max_tokens": rng.choice((32, 64, 96)),
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": SUPPORT_PROMPT},
            {"role": "user", "content": question},
        ],
    }


def _search_body(rng: random.Random) -> dict[str, Any]:
    doc = " ".join(rng.choice(WORDS) for _ in range(700))
    return {
        "model": "llama-3.1-8b",
        "stream": True,
        "max_tokens": 128,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"Summarise: {doc}"}],
    }


async def _scrape(session: aiohttp.ClientSession, url: str) -> str:
    try:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=1)) as r:
            return await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return ""


def _render(
    elapsed: float,
    duration: float,
    tenants: dict[str, TenantStats],
    replicas: list[tuple[str, Any]],
    cost: float,
) -> Group:
    t = Table(
        title=f"kvfleet gateway · {elapsed:4.1f} of {duration:.0f} s · cost ${cost:.4f}",
        expand=True,
    )
    t.add_column("tenant", no_wrap=True)
    for col in (
        "sent",
        "ok",
        "refused",
        f"TTFT p50 (last {WINDOW_S:.0f} s)",
        f"TTFT p99 (last {WINDOW_S:.0f} s)",
        "cache hits",
        "tokens out",
        "budget left",
    ):
        t.add_column(col, justify="right")
    now = time.monotonic()
    short = {"insufficient_quota": "budget", "rate_limit_exceeded": "rate"}
    for name, s in tenants.items():
        recent = [v for at, v in s.ttft if now - at <= WINDOW_S]
        refused = ", ".join(f"{short.get(k, k)} {v}" for k, v in s.rejected.items()) or "0"
        hit = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
        t.add_row(
            name,
            str(s.sent),
            str(s.ok),
            refused,
            f"{percentile(recent, 50) * 1000:.0f} ms" if recent else "-",
            f"{percentile(recent, 99) * 1000:.0f} ms" if recent else "-",
            f"{hit:.0%}",
            f"{s.completion_tokens:,}",
            s.budget_left,
        )
    r = Table(title="engine replicas, from their own /metrics", expand=True)
    for col in ("replica", "running", "queued", "KV used", "last prefill hit"):
        r.add_column(col, justify="right")
    for i, (_, sig) in enumerate(replicas):
        if sig is None:
            r.add_row(f"engine-{i}", "-", "-", "-", "-")
        else:
            r.add_row(
                f"engine-{i}",
                str(sig.running_reqs),
                str(sig.queue_reqs),
                f"{sig.token_usage:.1%}",
                f"{sig.cache_hit_rate:.0%}",
            )
    return Group(t, r)


async def _drive(
    gw: str, gw_metrics: str, urls: list[str], keys: dict[str, str], duration: float
) -> dict[str, Any]:
    rng = random.Random(11)
    tenants = {"support-chat": TenantStats(), "doc-search": TenantStats()}
    tasks: set[asyncio.Task[None]] = set()
    start = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def traffic(name: str, body: Any, rate: Any) -> None:
            while (elapsed := time.monotonic() - start) < duration:
                task = asyncio.create_task(
                    send_chat(session, gw, keys[name], body(rng), tenants[name])
                )
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(rng.expovariate(rate(elapsed)))

        def spike(t: float) -> float:  # support chat triples in the middle third
            return 30.0 if duration / 3 <= t < 2 * duration / 3 else 10.0

        loads = [
            asyncio.create_task(traffic("support-chat", support_body, spike)),
            asyncio.create_task(traffic("doc-search", _search_body, lambda t: 3.0)),
        ]
        cost = 0.0
        with live_view() as live:
            while not all(t.done() for t in loads):
                texts = await asyncio.gather(*(_scrape(session, u) for u in [*urls, gw_metrics]))
                replicas = [(u, parse_metrics(text)) for u, text in zip(urls, texts, strict=False)]
                for line in texts[-1].splitlines():
                    if line.startswith("kvfleet_gateway_cost_total"):
                        cost = sum(
                            float(x.rsplit(" ", 1)[1])
                            for x in texts[-1].splitlines()
                            if x.startswith("kvfleet_gateway_cost_total")
                        )
                        break
                live.update(_render(time.monotonic() - start, duration, tenants, replicas, cost))
                await asyncio.sleep(0.5)
            await asyncio.gather(*list(tasks))
    return {
        name: {
            "sent": s.sent,
            "ok": s.ok,
            "refused": s.rejected,
            "ttft_p50_ms": percentile([v for _, v in s.ttft], 50) * 1000,
            "ttft_p99_ms": percentile([v for _, v in s.ttft], 99) * 1000,
            "cache_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0,
        }
        for name, s in tenants.items()
    }


def run_stack_demo(duration: float, work: Path) -> dict[str, Any]:
    import sys

    with engines(3, work, stream_interval=4, name="demo-engine") as urls:
        port, metrics_port = free_port(), free_port()
        config, keys = _configs(work, urls, port, metrics_port)
        argv = [
            sys.executable,
            "-m",
            "kvfleet_cli",
            "gateway",
            "--config",
            str(config),
            "--log-level",
            "warning",
        ]
        gw = f"http://127.0.0.1:{port}"
        with running_process(
            argv, ready_url=f"{gw}/readyz", log_path=work / "gateway.log", timeout=30
        ):
            time.sleep(1.0)  # a first round of health checks and /metrics scrapes
            gw_metrics = f"http://127.0.0.1:{metrics_port}"
            return asyncio.run(_drive(gw, gw_metrics, urls, keys, duration))
