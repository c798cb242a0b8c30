"""The hostile-tenant run of `kvfleet bench reliability`: an honest tenant's time to first
token with and without an attacker holding two keys, on the same machine.

Processes, as in production: one simulated engine, Redis, and `kvfleet gateway` with the
product's default limits (pinned to core 0). The attacker (`hostile_clients`, pinned to core
1: its own CPU is not the gateway's in production) holds a key whose budget is spent and a
fresh one, and sends 1.4 MB bodies of small nested lists from both, gzip bombs of them, and
500 idle plus 50 trickling connections. The honest tenant streams 60 chat completions alone,
then 60 under the attack; TTFT is measured by its client (request sent → first content
chunk), and the report gives p50 and p99 of each, over the seeds, with what the attacker got.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvfleet_bench.hostile_clients import FRESH, SPENT
from kvfleet_bench.redis_server import RedisServer
from kvfleet_gateway.keys import hash_key
from kvfleet_sim.procs import free_port, running_process

MODEL = "llama-3.1-8b"
HONEST = "kvf-honest-tenant"
SAMPLES = 60


@dataclass(frozen=True)
class HostileRun:
    seed: int
    alone_p50_ms: float
    alone_p99_ms: float
    attacked_p50_ms: float
    attacked_p99_ms: float
    attacker: dict[str, Any]
    """What the attacker's requests got (statuses by kind, connections closed)."""


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, round(q * len(ordered)) - 1)] * 1000


async def _honest(gw: str, n: int, seed: int) -> list[float]:
    """TTFT of `n` streamed chats, one at a time with a short pause."""
    out = []
    body = {"model": MODEL, "max_tokens": 8, "stream": True,
            "messages": [{"role": "user", "content": f"status of the fleet {seed}"}]}  # fmt: skip
    headers = {"Authorization": f"Bearer {HONEST}"}
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            started = time.perf_counter()
            async with s.post(f"{gw}/v1/chat/completions", json=body, headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"the honest tenant got {r.status}: {await r.text()}")
                async for line in r.content:
                    if b'"content"' in line:
                        out.append(time.perf_counter() - started)
                        break
                await r.read()
            await asyncio.sleep(0.02)
    return out


def _config(work: Path, engine: str, redis_url: str, port: int) -> Path:
    tenants = [{"name": "honest", "keys": [hash_key(HONEST)]},
               {"name": "spent", "keys": [hash_key(SPENT)],
                "limits": {"tokenBudget": {"tokens": 1_000, "period": "1d"}}},
               {"name": "fresh", "keys": [hash_key(FRESH)]}]  # fmt: skip
    keys = work / "keys.yaml"
    keys.write_text(json.dumps({"tenants": tenants}))
    doc = {
        "listen": {"host": "127.0.0.1", "port": port, "metricsPort": free_port()},
        "backends": {"static": [engine]},
        "auth": {"keysFile": str(keys)},
        "limits": {"store": redis_url},
        "healthInterval": "0.5s",
        "accessLog": False,
    }
    path = work / "gateway.yaml"
    path.write_text(json.dumps(doc))
    return path


async def run_hostile(seed: int, work: Path) -> HostileRun:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    store = RedisServer(binary, work)
    store.start()
    # The spent key's budget, used to the token for today.
    store.client().hset("kvf:{spent}:budget", str(int(time.time() // 86400)), 1_000)
    port, engine_port = free_port(), free_port()
    gw, engine = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{engine_port}"
    sim = [sys.executable, "-m", "kvfleet_sim", "serve", "--model", MODEL, "--gpu", "h100",
           "--port", str(engine_port), "--time-scale", "0.02"]  # fmt: skip
    gateway = ["taskset", "-c", "0", sys.executable, "-m", "kvfleet_cli", "gateway",
               "--config", str(_config(work, engine, store.url, port))]  # fmt: skip
    try:
        with ExitStack() as stack:
            stack.enter_context(running_process(sim, f"{engine}/health", work / "sim.log"))
            stack.enter_context(running_process(gateway, f"{gw}/readyz", work / "gateway.log"))
            alone = await _honest(gw, SAMPLES, seed)
            attacker = await asyncio.create_subprocess_exec(
                "taskset", "-c", "1", sys.executable, "-m", "kvfleet_bench.hostile_clients",
                gw, MODEL, "15", "500", stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            await asyncio.sleep(0.5)
            attacked = await _honest(gw, SAMPLES, seed)
            out, _ = await attacker.communicate()
    finally:
        store.stop()
    return HostileRun(
        seed, _p(alone, 0.5), _p(alone, 0.99), _p(attacked, 0.5), _p(attacked, 0.99),
        json.loads(out.decode().splitlines()[-1]),
    )  # fmt: skip


def report(runs: list[HostileRun]) -> str:
    def spread(values: list[float]) -> str:
        return f"{statistics.mean(values):.1f} [{min(values):.1f}–{max(values):.1f}]"

    a = runs[0].attacker
    statuses = {k: dict(sorted({s: a[k].count(s) for s in set(a[k])}.items()))
                for k in ("spent", "fresh", "gzip")}  # fmt: skip
    return "\n".join([
        "## A hostile tenant (`kvfleet bench reliability`, hostile-tenant run)",
        "",
        f"{len(runs)} seeds; the gateway a process on core 0 with its default limits, the "
        "attacker on core 1; honest TTFT as its client sees it, ms, mean [min–max] over seeds:",
        "",
        "| honest tenant | TTFT p50 | TTFT p99 |",
        "|---|---|---|",
        f"| alone | {spread([r.alone_p50_ms for r in runs])} | "
        f"{spread([r.alone_p99_ms for r in runs])} |",
        f"| under attack | {spread([r.attacked_p50_ms for r in runs])} | "
        f"{spread([r.attacked_p99_ms for r in runs])} |",
        "",
        "The attacker, first seed: the spent key's 1.4 MB nested bodies "
        f"{statuses['spent']} (429: refused from its headers, the body unread), the fresh "
        f"key's {statuses['fresh']} (400: over requests.maxJsonContainers; 429: past its share "
        f"of parsing), gzip bombs {statuses['gzip']}; {a['connections_closed']} of "
        f"{a['connections']} idle and trickling connections closed by the gateway.",
        "",
    ])  # fmt: skip
