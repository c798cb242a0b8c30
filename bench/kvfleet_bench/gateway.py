"""`kvfleet bench gateway`: what the gateway costs, measured against direct calls and sglang-router.

Same run, same engines (simulator processes):
* added latency: client-side TTFT through the gateway minus TTFT calling the engines
  directly, at 64 and 256 concurrent streams;
* non-streaming throughput: requests/s through kvfleet's gateway and through the real
  `sglang-router` (0.3.2, its default cache_aware policy) in front of the same engines.
Everything shares this machine's cores, so absolute numbers include CPU contention between
the load generator, the proxies and the engines; the ratios are the point.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvfleet_bench.common import (
    StreamStats,
    closed_loop_rps,
    drive_streams,
    engines,
    kvfleet_gateway,
)
from kvfleet_bench.gateway_cost import cost_goals, cost_report, measure_costs
from kvfleet_sim.procs import sglang_router_process

STREAM_BODY = {
    "model": "llama-3.1-8b",
    "stream": True,
    "max_tokens": 32,
    "ignore_eos": True,
    "messages": [{"role": "user", "content": "Tell me about GPUs."}],
}
SMALL_BODY = {
    "model": "llama-3.1-8b",
    "max_tokens": 1,
    "ignore_eos": True,
    "messages": [{"role": "user", "content": "Hi"}],
}


def _direct(urls: list[str], streams: int, rounds: int, **kw: Any) -> StreamStats:
    """Clients split evenly over the engines, no proxy in between."""

    async def run() -> StreamStats:
        parts = await asyncio.gather(
            *(
                drive_streams(
                    u, "/v1/chat/completions", STREAM_BODY, streams // len(urls), rounds, **kw
                )
                for u in urls
            )
        )
        merged = StreamStats()
        for p in parts:
            merged.ttft += p.ttft
            merged.e2e += p.e2e
            merged.chunks += p.chunks
            merged.errors += p.errors
        return merged

    return asyncio.run(run())


MODES: dict[str, dict[str, Any]] = {
    # Steady concurrency: clients start spread over a second, first round not measured.
    "steady": {"stagger_s": 1.0, "warmup_rounds": 1},
    # Every client fires at the same instant: what a synchronized burst costs.
    "burst": {"stagger_s": 0.0, "warmup_rounds": 0},
}


def run_gateway_bench(
    out_dir: Path, log: Callable[[str], None], rps_seconds: float = 5.0, litellm: Path | None = None
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / ".gateway-bench"
    work.mkdir(exist_ok=True)
    result: dict[str, Any] = {"latency": [], "rps": {}}
    with engines(2, work) as urls:
        with kvfleet_gateway(urls, work) as gw:
            for mode, kw in MODES.items():
                for streams in (64, 256):
                    rounds = 4 if mode == "steady" else 1
                    direct = _direct(urls, streams, rounds, **kw)
                    via = asyncio.run(
                        drive_streams(
                            gw, "/v1/chat/completions", STREAM_BODY, streams, rounds, **kw
                        )
                    )
                    row = {
                        "mode": mode,
                        "streams": streams,
                        "direct_p50": direct.p(50),
                        "direct_p99": direct.p(99),
                        "gateway_p50": via.p(50),
                        "gateway_p99": via.p(99),
                        "added_p50_ms": (via.p(50) - direct.p(50)) * 1000,
                        "added_p99_ms": (via.p(99) - direct.p(99)) * 1000,
                        "errors": direct.errors + via.errors,
                    }
                    result["latency"].append(row)
                    log(
                        f"  {mode}, {streams} streams: TTFT p50 direct "
                        f"{direct.p(50) * 1000:.1f} ms, via gateway {via.p(50) * 1000:.1f} ms "
                        f"(added {row['added_p50_ms']:+.2f} ms p50, "
                        f"{row['added_p99_ms']:+.2f} ms p99)"
                    )
            rps, errors = asyncio.run(
                closed_loop_rps(gw, "/v1/chat/completions", SMALL_BODY, 64, rps_seconds)
            )
            result["rps"]["kvfleet"] = rps
            log(f"  non-streaming via kvfleet gateway: {rps:,.0f} req/s ({errors} errors)")
        with sglang_router_process(urls, work / "router.log") as router:
            rps, errors = asyncio.run(
                closed_loop_rps(router, "/v1/chat/completions", SMALL_BODY, 64, rps_seconds)
            )
            result["rps"]["sglang_router"] = rps
            log(f"  non-streaming via sglang-router: {rps:,.0f} req/s ({errors} errors)")
        rps, _ = asyncio.run(
            closed_loop_rps(urls[0], "/v1/chat/completions", SMALL_BODY, 64, rps_seconds)
        )
        result["rps"]["direct_one_engine"] = rps
        log("what one request costs each proxy (3 runs)")
        result["rows"] = measure_costs(urls, work, STREAM_BODY, SMALL_BODY, log, litellm)
        result["goals"] = cost_goals(result["rows"])
    result["rps"]["ratio_kvfleet_vs_router"] = result["rps"]["kvfleet"] / max(
        1e-9, result["rps"]["sglang_router"]
    )
    _plot(result, out_dir / "gateway.png")
    (out_dir / "gateway.md").write_text(_report(result, rps_seconds))
    for f in work.iterdir():
        f.unlink()
    work.rmdir()
    return result


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    rows = result["latency"]
    x = range(len(rows))
    for off, key, label in (
        (-0.3, "direct_p50", "direct p50"),
        (-0.1, "gateway_p50", "gateway p50"),
        (0.1, "direct_p99", "direct p99"),
        (0.3, "gateway_p99", "gateway p99"),
    ):
        ax1.bar([i + off for i in x], [r[key] * 1000 for r in rows], 0.2, label=label)
    ax1.set_xticks(list(x), [f"{r['mode']}\n{r['streams']} streams" for r in rows])
    ax1.set_ylabel("client TTFT (ms)")
    ax1.set_title("Time to first token: direct vs through the gateway")
    ax1.legend(fontsize=8)
    rps = result["rps"]
    names = ["kvfleet gateway", "sglang-router 0.3.2", "one engine, direct"]
    ax2.bar(
        names,
        [rps["kvfleet"], rps["sglang_router"], rps["direct_one_engine"]],
        color=["tab:blue", "tab:orange", "tab:gray"],
    )
    ax2.set_ylabel("non-streaming requests / s")
    ax2.set_title("Throughput in front of the same 2 engines")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _report(result: dict[str, Any], seconds: float) -> str:
    lines = [
        "# Gateway overhead",
        "",
        "Produced by `kvfleet bench gateway`: two simulated "
        "Llama-3.1-8B/H100 engines (processes), a kvfleet gateway process, the real "
        "`sglang-router==0.3.2` and (last section) the real LiteLLM proxy, all on this 2-core "
        "machine with the load generator.",
        "",
        "## Added time to first token (streaming chat, 32 tokens)",
        "",
        "Steady: clients start spread over one second and the first of their four requests "
        "is not measured. Burst: every client fires at the same instant.",
        "",
        "| load | streams | direct p50 | gateway p50 | added p50 | direct p99 | gateway p99 "
        "| added p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["latency"]:
        lines.append(
            f"| {r['mode']} | {r['streams']} | {r['direct_p50'] * 1000:.1f} ms | "
            f"{r['gateway_p50'] * 1000:.1f} ms | {r['added_p50_ms']:+.2f} ms | "
            f"{r['direct_p99'] * 1000:.1f} ms | {r['gateway_p99'] * 1000:.1f} ms | "
            f"{r['added_p99_ms']:+.2f} ms |"
        )
    rps = result["rps"]
    lines += [
        "",
        f"## Non-streaming throughput (64 clients, {seconds:.0f} s each, max_tokens 1)",
        "",
        "| path | requests/s |",
        "|---|---:|",
        f"| kvfleet gateway (kvfleet routing, auth off) | {rps['kvfleet']:,.0f} |",
        f"| sglang-router 0.3.2 (cache_aware) | {rps['sglang_router']:,.0f} |",
        f"| one engine, direct | {rps['direct_one_engine']:,.0f} |",
        "",
        f"**kvfleet / sglang-router: {rps['ratio_kvfleet_vs_router']:.2f}×**",
        "",
        *cost_report(result["rows"], result["goals"]),
        "![gateway](gateway.png)",
        "",
    ]
    return "\n".join(lines)
