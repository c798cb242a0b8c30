"""The gateway under abuse and a bad day at once: adversarial requests over several gateways
sharing one real Redis, with Redis killed and restarted in the middle.

Each run: 2 simulator engines, N gateways (the product's app, in this process) sharing a
redis-server with an append-only file; `requests` parallel requests from one budgeted tenant,
a seeded mix of honest chats, padded fields (role, tools), lone surrogates, JSON nested 10^5
deep, governed fields, wrong keys and streams cut after their first chunk; Redis is killed
while they run and started again. Then it counts what a platform team would ask: statuses
(never a 5xx other than the documented 503 while Redis is down), tokens billed against the
budget, leases and reservations left in Redis, and how long after Redis came back a budgeted
request was still refused. The same report carries the hostile-tenant run (`hostile`) and the
hostile request fields and specs, each with the figure it moves (`hostile_fields`).
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvfleet_bench.redis_server import RedisServer
from kvfleet_gateway.app import make_app
from kvfleet_gateway.config import GatewayConfig
from kvfleet_gateway.keys import hash_key
from kvfleet_gateway.redis_store import RedisStore
from kvfleet_gateway.serving import GatewayRunner
from kvfleet_gateway.state import GATEWAY
from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig
from kvfleet_sim.procs import free_port
from kvfleet_sim.server import ServerConfig
from kvfleet_sim.server import make_app as make_sim

KEY, WRONG = "kvf-reliability-key", "kvf-not-a-key"
MODEL = "llama-3.1-8b"
KINDS = (
    ("honest", 40),
    ("cut_stream", 15),
    ("padded_role", 12),
    ("padded_tools", 5),
    ("surrogate", 10),
    ("deep_json", 5),
    ("governed", 5),
    ("wrong_key", 8),
)


@dataclass(frozen=True)
class Run:
    seed: int
    requests: int
    gateways: int
    budget: int
    statuses: dict[str, int]
    by_kind: dict[str, dict[str, int]]
    billed: int
    engine_tokens: int
    leases_left: int
    reserved_left: int
    server_errors: int
    last_refusal_after_restart_s: float
    wall_s: float


def _body(kind: str, rng: random.Random) -> tuple[bytes, str, bool]:
    """(raw body, key, stream) for one request of `kind`."""
    chat: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": rng.randint(8, 64),
        "messages": [{"role": "user", "content": " word" * rng.randint(5, 200)}],
    }
    if kind == "padded_role":
        chat["messages"][0]["role"] = "user" + " word" * 60_000
    elif kind == "padded_tools":
        chat["tools"] = [
            {"type": "function", "function": {"name": "f", "description": "x" * 90_000}}
        ]
    elif kind == "governed":
        chat[rng.choice(["rid", "custom_logit_processor", "lora_path", "n"])] = 2
    elif kind == "deep_json":
        return b"[" * 100_000, KEY, False
    elif kind == "surrogate":
        raw = json.dumps(chat).replace('"content": "', '"content": "\\ud800', 1)
        return raw.encode(), KEY, False
    stream = kind == "cut_stream" or rng.random() < 0.5
    chat["stream"] = stream
    return json.dumps(chat).encode(), WRONG if kind == "wrong_key" else KEY, stream


async def _send(
    session: aiohttp.ClientSession, gw: str, kind: str, raw: bytes, key: str, stream: bool
) -> int:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    try:
        async with session.post(f"{gw}/v1/chat/completions", data=raw, headers=headers) as r:
            if kind == "cut_stream" and r.status == 200:
                await r.content.readuntil(b"\n\n")
                r.close()  # the client leaves after the first chunk
                return 499
            await r.read()
            return r.status
    except aiohttp.ClientError:
        return 599


async def _engine_tokens(session: aiohttp.ClientSession, engines: list[str]) -> int:
    total = 0.0
    for url in engines:
        async with session.get(f"{url}/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith(
                    ("sglang:prompt_tokens_total", "sglang:generation_tokens_total")
                ):
                    total += float(line.rsplit(" ", 1)[1])
    return int(total)


async def run_once(
    seed: int, work: Path, requests: int = 1000, gateways: int = 3, budget: int = 60_000
) -> Run:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    store = RedisServer(binary, work, appendonly=True)
    store.start()
    runners: list[web.AppRunner] = []
    try:
        engines = []
        for _ in range(2):
            port = free_port()
            cfg = ServerConfig(
                engine=EngineConfig(model=BUILTIN.model(MODEL), gpu=BUILTIN.gpu("h100")),
                served_model_name=MODEL,
                model_path="meta-llama/Llama-3.1-8B-Instruct",
                host="127.0.0.1",
                port=port,
                time_scale=0.02,
            )
            runner = web.AppRunner(make_sim(cfg), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            engines.append(f"http://127.0.0.1:{port}")
        keys = work / "keys.yaml"
        keys.write_text(
            json.dumps(
                {
                    "tenants": [
                        {
                            "name": "adv",
                            "keys": [hash_key(KEY)],
                            "limits": {"tokenBudget": {"tokens": budget, "period": "1d"}},
                        }
                    ]
                }
            )
        )
        urls = []
        for _ in range(gateways):
            port = free_port()
            config = GatewayConfig.from_dict(
                {
                    "listen": {"host": "127.0.0.1", "port": port, "metricsPort": free_port()},
                    "backends": {"static": engines},
                    "auth": {"keysFile": str(keys)},
                    "limits": {"store": store.url, "redisOutage": {"gatewayReplicas": gateways}},
                    "healthInterval": "0.5s",
                    "accessLog": False,
                }
            )
            runner = GatewayRunner(make_app(config), access_log=None, lingering_time=0.2)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{port}")
        await asyncio.sleep(1.0)  # a first round of health checks
        rng = random.Random(seed)
        kinds = [k for k, w in KINDS for _ in range(w)]
        plan = [rng.choice(kinds) for _ in range(requests)]
        t0 = time.monotonic()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one(i: int, kind: str) -> tuple[str, int]:
                await asyncio.sleep(rng.uniform(0, 2.0))  # spread over 2 s, around the restart
                raw, key, stream = _body(kind, rng)
                return kind, await _send(session, urls[i % gateways], kind, raw, key, stream)

            load = asyncio.gather(*(one(i, k) for i, k in enumerate(plan)))
            await asyncio.sleep(0.8)
            store.kill()
            await asyncio.sleep(0.5)
            await asyncio.to_thread(store.start)
            back = time.monotonic()
            probes: list[tuple[float, int]] = []
            honest = json.dumps(
                {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            )
            while time.monotonic() - back < 6:
                status = await _send(
                    session, urls[len(probes) % gateways], "honest", honest.encode(), KEY, False
                )
                probes.append((time.monotonic() - back, status))
                await asyncio.sleep(0.1)
            results = await load
            # Settlements made while Redis was down are written back by the retry loop.
            stores = [r.app[GATEWAY].store for r in runners[2:] if isinstance(r, web.AppRunner)]
            for _ in range(100):
                if not any(isinstance(s, RedisStore) and s.pending for s in stores):
                    break
                await asyncio.sleep(0.1)
            engine_tokens = await _engine_tokens(session, engines)
        wall = time.monotonic() - t0
        client = store.client()
        # A client has its answer before its gateway has settled the request (the settlement
        # runs as the response ends): give settlements in flight a moment, not a lease's TTL.
        for _ in range(50):
            if not client.zcard("kvf:{adv}:leases"):
                break
            await asyncio.sleep(0.1)
        period = str(int(time.time() // 86400))
        billed = int(client.hget("kvf:{adv}:budget", period) or 0)
        leases = int(client.zcard("kvf:{adv}:leases"))
        reserved = int(client.get("kvf:{adv}:rtot") or 0)
        client.close()
        by_kind: dict[str, Counter[str]] = {}
        for kind, status in results:
            by_kind.setdefault(kind, Counter())[str(status)] += 1
        statuses = Counter(str(s) for _, s in results)
        return Run(
            seed=seed,
            requests=requests,
            gateways=gateways,
            budget=budget,
            statuses=dict(statuses),
            by_kind={k: dict(v) for k, v in sorted(by_kind.items())},
            billed=billed,
            engine_tokens=engine_tokens,
            leases_left=leases,
            reserved_left=reserved,
            server_errors=sum(n for s, n in statuses.items() if s.startswith("5") and s != "503"),
            last_refusal_after_restart_s=max((t for t, s in probes if s != 200), default=0.0),
            wall_s=wall,
        )
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        store.stop()


def report(runs: list[Run]) -> str:
    def spread(values: list[float], fmt: str = "{:.0f}") -> str:
        mean = statistics.mean(values)
        return f"{fmt.format(mean)} [{fmt.format(min(values))}–{fmt.format(max(values))}]"

    r0 = runs[0]
    lines = [
        "# Reliability under abuse (`kvfleet bench reliability`)",
        "",
        f"{r0.requests} parallel requests (spread over 2 s) from one budgeted tenant over "
        f"{r0.gateways} gateways sharing one redis-server (AOF), 2 simulator engines; Redis "
        "is killed 0.8 s in and started again 0.5 s later. Mix: "
        + ", ".join(f"{k} {w}%" for k, w in KINDS)
        + f". {len(runs)} seeds; mean [min–max].",
        "",
        "| measure | value |",
        "|---|---|",
        f"| tokens billed (budget {r0.budget:,}) | {spread([r.billed for r in runs])} |",
        f"| tokens the engines counted | {spread([r.engine_tokens for r in runs])} |",
        f"| leases left in Redis after | {spread([r.leases_left for r in runs])} |",
        f"| reserved tokens left in Redis after | {spread([r.reserved_left for r in runs])} |",
        f"| 5xx other than 503 (500, 502, …) | {spread([r.server_errors for r in runs])} |",
        "| last budgeted request refused after Redis was back (s) | "
        + spread([r.last_refusal_after_restart_s for r in runs], "{:.1f}")
        + " |",
        f"| wall time per run (s) | {spread([r.wall_s for r in runs], '{:.1f}')} |",
        "",
        "Statuses by kind of request (first seed; 499 = the client cut the stream itself, 503 ="
        " budgets fail closed while Redis is down):",
        "",
        "| kind | statuses |",
        "|---|---|",
    ]
    for kind, counts in r0.by_kind.items():
        lines.append(
            f"| {kind} | " + ", ".join(f"{s}: {n}" for s, n in sorted(counts.items())) + " |"
        )
    return "\n".join(lines) + "\n"


def run_reliability_bench(
    out_dir: Path, work: Path, seeds: int = 3, requests: int = 1000
) -> list[Run]:
    """The three parts of the report, each run and written in `reliability.md`: abusive
    requests over gateways with a Redis restart, a hostile tenant against an honest one, and
    issue 55's hostile fields and specs (`hostile_fields`), once each."""
    from kvfleet_bench import hostile, hostile_fields

    runs, hostile_runs = [], []
    for seed in range(seeds):
        (work / f"seed-{seed}").mkdir(parents=True, exist_ok=True)
        runs.append(asyncio.run(run_once(seed, work / f"seed-{seed}", requests)))
        (work / f"hostile-{seed}").mkdir(parents=True, exist_ok=True)
        hostile_runs.append(asyncio.run(hostile.run_hostile(seed, work / f"hostile-{seed}")))
    (work / "fields").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    vectors = hostile_fields.run_hostile_fields(work / "fields", lambda _: None)
    fields = hostile_fields.report(vectors, time.perf_counter() - started)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = [report(runs), hostile.report(hostile_runs), fields]
    (out_dir / "reliability.md").write_text("\n\n".join(p.strip("\n") for p in parts) + "\n")
    return runs
