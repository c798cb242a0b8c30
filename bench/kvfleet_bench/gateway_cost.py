"""What one request costs each proxy: requests/s, the proxy process's CPU time per request
(user + system, from /proc) and, streaming, the TTFT it adds at p50 over calling the engines
directly. kvfleet's gateway, the real sglang-router and the real LiteLLM proxy in front of the
same two engines, in the same run, on the same cores, 3 runs (mean, [min–max]). kvfleet runs
with auth off, LiteLLM with a master key (it refuses to start without one; a string
comparison per request).

Streaming: 256 clients, steady (spread over one second), 4 requests each of 32 tokens, the
first not timed. Non-streaming: 64 clients in a closed loop for 5 s, max_tokens 1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from statistics import fmean
from typing import Any

from kvfleet_bench.common import closed_loop_rps, cpu_seconds, drive_streams, kvfleet_gateway
from kvfleet_bench.litellm_peer import HEADERS, LITELLM_VERSION, litellm_process
from kvfleet_sim.procs import sglang_router_process

STREAMS = 256
PLAIN_CLIENTS = 64
RUNS = 3
PATH = "/v1/chat/completions"


Headers = dict[str, str] | None
Starter = Callable[[Callable[[int], None]], AbstractContextManager[str]]


def _stream(url: str, body: dict[str, Any], headers: Headers = None) -> tuple[float, float, int]:
    """(streams/s, TTFT p50, requests timed)."""
    t0 = time.perf_counter()
    stats = asyncio.run(
        drive_streams(url, PATH, body, STREAMS, 4, headers, stagger_s=1.0, warmup_rounds=1)
    )
    wall = time.perf_counter() - t0
    return STREAMS * 4 / wall, stats.p(50), len(stats.ttft)


def _measure(
    path: str, url: str, pid: int | None, stream_body: dict[str, Any], plain: dict[str, Any],
    direct_p50: float | None, headers: Headers = None,
) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    for mode in ("stream", "plain"):
        cpu0 = cpu_seconds(pid) if pid else 0.0
        if mode == "stream":
            rps, p50, _ = _stream(url, stream_body, headers)
            requests = STREAMS * 4
        else:
            rps, _ = asyncio.run(closed_loop_rps(url, PATH, plain, PLAIN_CLIENTS, 5.0, headers))
            p50, requests = None, int(rps * 5.0)
        cpu = (cpu_seconds(pid) - cpu0) if pid else 0.0
        rows.append({
            "path": path,
            "mode": mode,
            "rps": rps,
            "cpu_ms_per_request": cpu * 1000 / max(1, requests),
            "added_ttft_p50_ms": None if p50 is None or direct_p50 is None
            else (p50 - direct_p50) * 1000,
            "streams": STREAMS if mode == "stream" else PLAIN_CLIENTS,
        })  # fmt: skip
    return rows


def measure_costs(
    urls: list[str], work: Path, stream_body: dict[str, Any], plain: dict[str, Any],
    log: Callable[[str], None], litellm: Path | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every path, `RUNS` times, merged: mean with [min, max] of each number. LiteLLM is
    measured when `litellm` names its `litellm` command."""
    runs: list[dict[str, Any]] = []
    for run in range(RUNS):
        # Direct: the engines' own TTFT, the baseline each proxy's added TTFT is taken from.
        _, direct_p50, _ = _stream(urls[0], stream_body)
        runs += _measure("direct", urls[0], None, stream_body, plain, direct_p50)
        proxies = list(_proxies(urls, work, litellm))
        for path, start, headers in proxies:
            pid: list[int] = []
            with start(pid.append) as url:
                runs += _measure(path, url, pid[0], stream_body, plain, direct_p50, headers)
        for r in runs[-2 * (len(proxies) + 1) :]:
            log(
                f"  run {run + 1} {r['path']:13s} {r['mode']:6s} {r['rps']:7,.0f} req/s "
                f"{r['cpu_ms_per_request']:.2f} ms CPU/request"
            )
    return _merge(runs)


def _proxies(
    urls: list[str], work: Path, litellm: Path | None
) -> Iterator[tuple[str, Starter, Headers]]:
    yield (
        "kvfleet",
        lambda cb: kvfleet_gateway(urls, work, log_name="cost-gw.log", on_started=cb),
        None,
    )
    yield (
        "sglang-router",
        lambda cb: sglang_router_process(urls, work / "cost-router.log", on_started=cb),
        None,
    )
    if litellm is not None:
        yield "litellm", lambda cb: litellm_process(litellm, urls, work, on_started=cb), HEADERS


def _merge(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    keys = dict.fromkeys((r["path"], r["mode"]) for r in runs)
    for path, mode in keys:
        mine = [r for r in runs if (r["path"], r["mode"]) == (path, mode)]
        row: dict[str, Any] = {"path": path, "mode": mode, "streams": mine[0]["streams"]}
        for k in ("rps", "cpu_ms_per_request", "added_ttft_p50_ms"):
            values = [r[k] for r in mine if r[k] is not None]
            row[k] = fmean(values) if values else None
            row[f"{k}_min"] = min(values) if values else None
            row[f"{k}_max"] = max(values) if values else None
        out.append(row)
    return out


def cost_goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["path"], r["mode"]): r for r in rows}
    ours_s, ref_s = by[("kvfleet", "stream")], by[("sglang-router", "stream")]
    ours_p, ref_p = by[("kvfleet", "plain")], by[("sglang-router", "plain")]

    def goal(what: str, value: float, met: bool) -> dict[str, Any]:
        return {"goal": what, "value": value, "met": met}

    return [
        goal("streaming requests/s ≥ 1.0× sglang-router's (worst run)",
             ours_s["rps_min"] / ref_s["rps_max"], ours_s["rps_min"] >= ref_s["rps_max"]),
        goal("non-streaming requests/s ≥ 0.9× sglang-router's (worst run)",
             ours_p["rps_min"] / ref_p["rps_max"], ours_p["rps_min"] >= 0.9 * ref_p["rps_max"]),
        goal("added TTFT p50 ≤ 5 ms at 256 streams (worst run)",
             ours_s["added_ttft_p50_ms_max"], ours_s["added_ttft_p50_ms_max"] <= 5.0),
        goal("CPU per streamed request ≤ 1.5× sglang-router's (worst run)",
             ours_s["cpu_ms_per_request_max"] / ref_s["cpu_ms_per_request_min"],
             ours_s["cpu_ms_per_request_max"] <= 1.5 * ref_s["cpu_ms_per_request_min"]),
    ]  # fmt: skip


def cost_report(rows: list[dict[str, Any]], goals: list[dict[str, Any]]) -> list[str]:
    def cell(r: dict[str, Any], k: str, fmt: str) -> str:
        if r[k] is None:
            return "–"
        return f"{r[k]:{fmt}} [{r[k + '_min']:{fmt}}–{r[k + '_max']:{fmt}}]"

    lines = [
        "## What one request costs each proxy",
        "",
        (__doc__ or "").split("\n\n")[0].replace("\n", " "),
        "",
        "| path | mode | clients | requests/s | proxy CPU per request | added TTFT p50 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['path']} | {r['mode']} | {r['streams']} | {cell(r, 'rps', ',.0f')} | "
            f"{cell(r, 'cpu_ms_per_request', '.2f')} ms | "
            f"{cell(r, 'added_ttft_p50_ms', '+.1f')} ms |"
        )
    by = {(r["path"], r["mode"]): r for r in rows}
    if ("litellm", "stream") in by:
        ours = by[("kvfleet", "stream")]["cpu_ms_per_request"]
        theirs = by[("litellm", "stream")]["cpu_ms_per_request"]
        lines += ["", f"LiteLLM {LITELLM_VERSION} spends {theirs:.1f} ms of CPU per streamed "
                  f"request, {theirs / ours:.0f}× kvfleet's."]  # fmt: skip
    else:
        lines += ["", "LiteLLM not measured in this run (`--litellm`; `make bench` passes it)."]
    met = sum(g["met"] for g in goals)
    lines += ["", f"Goals: {met} of {len(goals)} met.", "", "| goal | value | met |",
              "|---|---:|:---:|"]  # fmt: skip
    lines += [f"| {g['goal']} | {g['value']:.2f} | {'yes' if g['met'] else '**no**'} |"
              for g in goals]  # fmt: skip
    router = by[("sglang-router", "stream")]
    lines += ["", "The same bound on the peer: sglang-router adds "
              f"{cell(router, 'added_ttft_p50_ms', '+.1f')} ms to TTFT p50 at {router['streams']} "
              "streams in this run (the 5 ms goal, applied to it, is "
              f"{'met' if router['added_ttft_p50_ms_max'] <= 5.0 else 'not met'})."]  # fmt: skip
    return [*lines, ""]
