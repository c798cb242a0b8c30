"""Helpers shared by the benchmarks: process CPU, latency percentiles, load generation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvfleet_sim.fleet.collector import percentile
from kvfleet_sim.fleet.workloads import Arrival
from kvfleet_sim.procs import free_port, running_process, sim_serve_argv


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class StreamStats:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    chunks: int = 0
    errors: int = 0

    def p(self, q: float, which: str = "ttft") -> float:
        return percentile(getattr(self, which), q)


async def drive_streams(
    url: str,
    path: str,
    body: dict[str, Any],
    streams: int,
    rounds: int = 1,
    headers: dict[str, str] | None = None,
    stagger_s: float = 0.0,
    warmup_rounds: int = 0,
) -> StreamStats:
    """`streams` concurrent clients, each sending `rounds` streaming requests back to back.

    With `stagger_s`, clients start spread over that many seconds (steady concurrency
    instead of one synchronized burst); the first `warmup_rounds` of each client are not
    measured.
    """
    stats = StreamStats()

    async def client(session: aiohttp.ClientSession, index: int) -> None:
        if stagger_s:
            await asyncio.sleep(stagger_s * index / streams)
        for n in range(rounds):
            t0 = time.perf_counter()
            first = None
            try:
                async with session.post(url + path, json=body, headers=headers) as resp:
                    if resp.status != 200:
                        stats.errors += 1
                        await resp.read()
                        continue
                    async for line in resp.content:
                        if line.startswith(b"data: {"):
                            if first is None:
                                first = time.perf_counter() - t0
                            stats.chunks += 1
            except aiohttp.ClientError:
                stats.errors += 1
                continue
            if first is not None and n >= warmup_rounds:
                stats.ttft.append(first)
                stats.e2e.append(time.perf_counter() - t0)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session, i) for i in range(streams)))
    return stats


async def closed_loop_rps(
    url: str,
    path: str,
    body: dict[str, Any],
    concurrency: int,
    seconds: float,
    headers: dict[str, str] | None = None,
) -> tuple[float, int]:
    """Non-streaming requests per second with `concurrency` clients for `seconds`."""
    done = errors = 0
    deadline = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done, errors
        while time.perf_counter() < deadline:
            try:
                async with session.post(url + path, json=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status == 200:
                        done += 1
                    else:
                        errors += 1
            except aiohttp.ClientError:
                errors += 1

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return done / (time.perf_counter() - t0), errors


@contextlib.contextmanager
def engines(
    n: int, workdir: Path, stream_interval: int = 2, name: str = "engine"
) -> Iterator[list[str]]:
    """`n` real-time simulator engines (processes) on free ports; stopped on exit."""
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(n):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(
                running_process(
                    sim_serve_argv(port, extra=["--stream-interval", str(stream_interval)]),
                    ready_url=f"{url}/health",
                    log_path=workdir / f"{name}-{i}.log",
                )
            )
            urls.append(url)
        yield urls


@contextlib.contextmanager
def kvfleet_gateway(
    backends: list[str],
    workdir: Path,
    policy: str = "kvfleet",
    log_name: str = "gateway.log",
    on_started: Callable[[int], None] | None = None,
    extra: Sequence[str] = (),
) -> Iterator[str]:
    """`kvfleet gateway` as a process in front of `backends` (auth off: a benchmark);
    `on_started` is given its process id; `extra`: more flags (`--prefill URL`)."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "kvfleet_cli",
        "gateway",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics-port",
        str(free_port()),
        "--insecure-no-auth",
        "--policy",
        policy,
        "--log-level",
        "warning",
        *[a for b in backends for a in ("--backend", b)],
        *extra,
    ]
    url = f"http://127.0.0.1:{port}"
    with running_process(
        argv, ready_url=f"{url}/readyz", log_path=workdir / log_name, timeout=30
    ) as proc:
        if on_started is not None:
            on_started(proc.pid)
        yield url


@dataclass
class ChatOutcome:
    """What a client saw of one streaming chat completion."""

    status: int
    error_code: str | None = None
    ttft: float | None = None
    first_token_at: float | None = None
    """time.monotonic() when the first token arrived."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    headers: dict[str, str] = field(default_factory=dict)


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> ChatOutcome:
    """POST a streaming chat completion (with include_usage) and read it to the end."""
    t0 = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            out = ChatOutcome(r.status, headers=dict(r.headers))
            if r.status != 200:
                try:
                    err = (await r.json()).get("error") or {}
                except (ValueError, aiohttp.ContentTypeError):
                    err = {}
                out.error_code = (err.get("code") if isinstance(err, dict) else None) or str(
                    r.status
                )
                return out
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if out.ttft is None and chunk.get("choices"):
                    out.ttft = time.perf_counter() - t0
                    out.first_token_at = time.monotonic()
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens += usage["prompt_tokens"]
                    out.completion_tokens += usage["completion_tokens"]
                    out.cached_tokens += (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ) or 0
            return out
    except aiohttp.ClientError:
        return ChatOutcome(0, error_code="connection")


class Replay:
    """Arrivals already drawn, as a workload the fleet simulator iterates."""

    def __init__(self, arrivals: list[Arrival]) -> None:
        self.arrivals = arrivals

    def __iter__(self) -> Iterator[Arrival]:
        return iter(self.arrivals)

    def follow_up(self, *_: Any) -> None:
        return None
