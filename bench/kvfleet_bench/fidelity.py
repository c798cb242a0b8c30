"""`kvfleet bench sim`: fidelity against published GPU numbers, and the simulator's own speed.

Writes `bench/results/sim-fidelity.md` and `sim-fidelity.png`. Every speed number comes with
a baseline measured in the same run: the fleet DES against real time, the streaming server
against a bare aiohttp SSE loop sending the same chunks.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvfleet_bench.common import cpu_seconds, drive_streams
from kvfleet_bench.fidelity_rows import ROWS, FidelityRow, load_model
from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig, derive_layout
from kvfleet_sim.costmodel import StepShape
from kvfleet_sim.fleet.des import FleetSimulator
from kvfleet_sim.fleet.model import FleetConfig
from kvfleet_sim.fleet.routing import fleet_policy
from kvfleet_sim.fleet.traces import RateTrace
from kvfleet_sim.fleet.workloads import Workload, WorkloadSpec
from kvfleet_sim.measured import build_cost_model, profiled_entry
from kvfleet_sim.offline import run_offline
from kvfleet_sim.procs import free_port, running_process, sim_serve_argv


def _config(row: FidelityRow) -> EngineConfig:
    return EngineConfig(
        model=load_model(row.model), gpu=BUILTIN.gpu(row.gpu), tp_size=row.tp, **row.extra
    )


def dominant_terms(config: EngineConfig, profile: str) -> tuple[str, str]:
    """Which cost term dominates a typical prefill chunk and a typical decode step (under the
    default truth: measured timings where profiled)."""
    cm = build_cost_model(derive_layout(config), profile)
    pre = cm.step_cost(
        StepShape(
            prefill_tokens=8192,
            prefill_seqs=8,
            prefill_attn_pairs=8 * StepShape.prefill_pairs(1024, 0),
        )
    )
    dec = cm.step_cost(StepShape(decode_seqs=256, decode_ctx_tokens=256 * 1024))
    return pre.dominant(), dec.dominant()


def _error(simulated: float | None, published: float | None) -> float | None:
    return None if simulated is None or published is None else simulated / published - 1


def fidelity(
    log: Callable[[str], None], table: Sequence[FidelityRow] = ROWS
) -> list[dict[str, Any]]:
    """Simulate every row under both cost models and score each against its published number.

    `simulated` is the default truth: the measured-timing model where the (model, GPU, TP)
    triple is profiled, the roofline elsewhere; `roofline` and `measured` are each model on
    its own (`measured` is None where nothing was profiled)."""
    rows = []
    for row in table:
        config = _config(row)
        roof = run_offline(config, row.spec, row.profile, truth="roofline").output_throughput
        profiled = profiled_entry(derive_layout(config)) is not None
        meas = (
            run_offline(config, row.spec, row.profile, truth="measured").output_throughput
            if profiled
            else None
        )
        simulated = roof if meas is None else meas
        pre, dec = dominant_terms(config, row.profile)
        rows.append(
            {
                "name": row.name,
                "kind": row.kind,
                "engine": row.engine,
                "moe": row.moe,
                "source": row.source,
                "gpu": f"{row.tp}× {row.gpu}",
                "profile": row.profile,
                "truth": "measured" if profiled else "roofline",
                "simulated": simulated,
                "roofline": roof,
                "measured": meas,
                "published": row.published,
                "error": _error(simulated, row.published),
                "error_roofline": _error(roof, row.published),
                "error_measured": _error(meas, row.published),
                "prefill_dominant": pre,
                "decode_dominant": dec,
            }
        )
        both = "" if meas is None else f", measured {meas:,.0f}"
        err = "" if row.published is None else f" (published {row.published:,.0f})"
        log(f"  {row.name} on {row.tp}× {row.gpu}: roofline {roof:,.0f}{both} tok/s{err}")
    return rows


def des_speed(num_requests: int) -> dict[str, float]:
    """Shared-prefix workload on 8 H100 replicas of Llama-3.1-8B, near saturation."""
    cfg = FleetConfig(
        EngineConfig(model=BUILTIN.model("llama-3.1-8b"), gpu=BUILTIN.gpu("h100")), replicas=8
    )
    workload = Workload(
        WorkloadSpec("generated-shared-prefix", num_requests),
        RateTrace("poisson", rate=150.0),
        128_256,
    )
    t0 = time.process_time()
    result = FleetSimulator(cfg, fleet_policy("round_robin")).run(workload)
    cpu = time.process_time() - t0
    return {
        "requests": num_requests,
        "cpu_s": cpu,
        "simulated_s": result.summary.duration_s,
        "speedup_vs_real_time": result.summary.duration_s / cpu,
    }


BARE_SSE_SERVER = """
import asyncio, json, sys
from aiohttp import web
chunks, delay = int(sys.argv[2]), float(sys.argv[3])
async def gen(request):
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    text = ""
    for i in range(chunks):
        await asyncio.sleep(delay)
        text += " word"
        await resp.write(b"data: " + json.dumps({"text": text, "meta_info": {"id": "x",
            "completion_tokens": i + 1}}).encode() + b"\\n\\n")
    await resp.write(b"data: [DONE]\\n\\n")
    return resp
async def health(request):
    return web.Response()
app = web.Application()
app.router.add_post("/generate", gen)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def _timed_streams(url: str, streams: int, max_tokens: int) -> tuple[float, int]:
    body = {
        "text": "benchmark",
        "stream": True,
        "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True},
    }
    t0 = time.monotonic()
    stats = asyncio.run(drive_streams(url, "/generate", body, streams))
    return time.monotonic() - t0, stats.chunks


def stream_cpu(streams: int, max_tokens: int, interval: int, workdir: Path) -> dict[str, float]:
    """Server CPU (% of one core) to carry `streams` concurrent streams, vs a bare SSE loop."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = sim_serve_argv(port, extra=["--stream-interval", str(interval), "--no-eos"])
    with running_process(argv, ready_url=f"{url}/health", log_path=workdir / "sim-bench.log") as p:
        c0 = cpu_seconds(p.pid)
        wall, chunks = _timed_streams(url, streams, max_tokens)
        sim_cpu = cpu_seconds(p.pid) - c0
    per_stream = chunks // streams
    bare_port = free_port()
    delay = wall / max(1, per_stream)
    script = workdir / "bare_sse.py"
    script.write_text(BARE_SSE_SERVER)
    bare_argv = [sys.executable, str(script), str(bare_port), str(per_stream), f"{delay:.5f}"]
    with running_process(bare_argv, ready_url=f"http://127.0.0.1:{bare_port}/health") as p:
        c0 = cpu_seconds(p.pid)
        bare_wall, _ = _timed_streams(f"http://127.0.0.1:{bare_port}", streams, max_tokens)
        bare_cpu = cpu_seconds(p.pid) - c0
    return {
        "streams": streams,
        "stream_interval": interval,
        "chunks": chunks,
        "wall_s": wall,
        "server_core_share": sim_cpu / wall,
        "bare_sse_core_share": bare_cpu / bare_wall,
        "ratio_vs_bare_sse": (sim_cpu / wall) / max(1e-9, bare_cpu / bare_wall),
    }


BAND = 0.25
"""The error band the fit rows are tested at (tests/unit/test_fidelity.py); held-out rows are
counted against the same band, set before any held-out row was simulated."""
HELD_OUT_BAND_MEASURED = 0.15
"""Held-out rows on a profiled triple (the measured-timing truth): vidur reports under 9%
error against the engine it profiled (vLLM); the published rows come from other engines
(TensorRT-LLM), so the band is wider. Measured: -7.7% (Llama-3.1-8B FP16 on A100)."""
HELD_OUT_BAND_ROOFLINE = 0.65
"""Held-out rows on the roofline: its worst measured error (+61%, vLLM's DeepSeek-R1, whose
arrival rate is not published), rounded up. The band bounds a regression; it claims no
accuracy — the median below and the table say how far off the roofline is."""
HELD_OUT_MEDIAN_BAND = 0.20
"""Median |error| over all held-out rows under the default truth (measured: 15%)."""


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["published"] is not None]
    fig, ax = plt.subplots(figsize=(11, 5.5))
    xs = range(len(shown))
    labels = [f"{r['name']}\n{r['gpu']} · {r['engine']} ({r['kind']})" for r in shown]
    w = 0.27
    ax.bar([x - w for x in xs], [r["roofline"] for r in shown], w, label="simulator: roofline")
    measured = [(x, r) for x, r in zip(xs, shown, strict=True) if r["measured"] is not None]
    ax.bar(
        [x for x, _ in measured],
        [r["measured"] for _, r in measured],
        w,
        label="simulator: measured GPU timings (profiled rows only)",
    )
    ax.bar([x + w for x in xs], [r["published"] for r in shown], w, label="published")
    for x, r in zip(xs, shown, strict=True):
        ax.annotate(
            f"{r['error']:+.0%}",
            (x, max(r["simulated"], r["published"])),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_xticks(list(xs), labels, rotation=35, ha="right", fontsize=6)
    ax.set_yscale("log")
    ax.set_ylabel("output tokens / s (log)")
    ax.set_title("Simulated vs published throughput (label: error of the default truth)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def held_out_summary(rows: list[dict[str, Any]], key: str = "error") -> dict[str, Any]:
    """The headline: held-out error (under the default truth, or `key`: `error_roofline`,
    `error_measured`), median and worst, and how many rows fall in the band."""
    held = [r for r in rows if r["kind"] == "held-out" and r[key] is not None]
    errors = sorted(abs(r[key]) for r in held)
    worst = max(held, key=lambda r: abs(r[key]))
    mid = len(errors) // 2
    median = errors[mid] if len(errors) % 2 else (errors[mid - 1] + errors[mid]) / 2
    return {
        "rows": len(held),
        "sources": len({r["source"] for r in held}),
        "median_abs_error": median,
        "worst": worst,
        "worst_error": worst[key],
        "within_band": sum(e <= BAND for e in errors),
    }


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _table(rows: list[dict[str, Any]], with_source: bool) -> list[str]:
    head = "| workload | GPUs | engine (published) | truth | roofline tok/s | measured tok/s "
    head += "| published | error (roofline) | error (measured) | prefill bound by "
    head += "| decode bound by |"
    lines = [head, "|---|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['gpu']} | {r['engine']} | {r['truth']} | "
            f"{r['roofline']:,.0f} | {_num(r['measured'], ',.0f')} | "
            f"{_num(r['published'], ',.0f')} | {_num(r['error_roofline'], '+.1%')} | "
            f"{_num(r['error_measured'], '+.1%')} | {r['prefill_dominant']} | "
            f"{r['decode_dominant']} |"
        )
    if with_source:
        lines += ["", "Sources:"]
        for source in dict.fromkeys(r["source"] for r in rows):
            lines.append(f"- {source}")
    return lines


def _headline(summary: dict[str, Any], what: str) -> str:
    worst = summary["worst"]
    return (
        f"{what}: median {summary['median_abs_error']:.0%}, worst {summary['worst_error']:+.0%} "
        f"({worst['name']}, {worst['engine']}); {summary['within_band']} of {summary['rows']} "
        f"within ±{BAND:.0%}"
    )


def fidelity_section(rows: list[dict[str, Any]]) -> list[str]:
    summary = held_out_summary(rows)
    roofline = held_out_summary(rows, "error_roofline")
    measured = [r for r in rows if r["kind"] == "held-out" and r["measured"] is not None]
    of = {kind: [r for r in rows if r["kind"] == kind] for kind in ("fit", "held-out")}
    label = (
        f"Held-out error under the default truth (nothing was fitted to these "
        f"{summary['rows']} results from {summary['sources']} sources)"
    )
    lines = [
        "## Throughput against published GPU results",
        "",
        f"**{_headline(summary, label)}.**",
        "",
        "The default truth is the measured-timing cost model (vidur's per-operator GPU "
        "timings, `kvfleet_sim/data/vidur/`) wherever the model, GPU and TP degree were "
        "profiled, and the roofline elsewhere. "
        f"{len(measured)} of {summary['rows']} held-out rows run on a profiled triple: "
        + (
            ", ".join(
                f"{r['name']} on {r['gpu']}: roofline {r['error_roofline']:+.1%}, "
                f"measured {r['error_measured']:+.1%}"
                for r in measured
            )
            or "none"
        )
        + f". {_headline(roofline, 'The roofline alone on every held-out row')}. Every "
        "held-out row runs the default `sglang` profile, the one every kvfleet benchmark runs.",
        "",
        "### Held-out rows",
        "",
        *_table(of["held-out"], with_source=True),
        "",
        "### Fit rows (the profiles' constants were fitted to these: in-sample)",
        "",
        *_table(of["fit"], with_source=True),
        "",
        "### Predictions (no published figure)",
        "",
        *_table([r for r in rows if r["kind"] == "prediction"], with_source=False),
        "",
        "![throughput](sim-fidelity.png)",
        "",
        "Dominant terms (default truth): a prefill batch of 8 × 1,024 new tokens, and a decode "
        "step of 256 requests at 1,024 tokens of context; `measured` rows name the measured "
        "model's largest term.",
    ]
    return lines


def report(
    rows: list[dict[str, Any]], des: dict[str, float], streams: list[dict[str, float]], command: str
) -> str:
    lines = [
        "# Simulator fidelity and speed",
        "",
        f"Produced by `{command}`.",
        "",
        *fidelity_section(rows),
        "",
        "## Speed of the simulator itself",
        "",
        f"- Fleet DES: {des['requests']:,} shared-prefix requests on 8 replicas in "
        f"{des['cpu_s']:.1f} s of one core, simulating {des['simulated_s']:.0f} s: "
        f"**{des['speedup_vs_real_time']:.1f}× faster than real time**.",
    ]
    for s in streams:
        lines.append(
            f"- Real-time server, {s['streams']} concurrent streams, stream interval "
            f"{s['stream_interval']}: **{s['server_core_share']:.0%} of one core** "
            f"({s['chunks']:,} chunks in {s['wall_s']:.1f} s); a bare aiohttp SSE loop sending "
            f"the same chunks used {s['bare_sse_core_share']:.0%} "
            f"(ratio {s['ratio_vs_bare_sse']:.2f}×)."
        )
    return "\n".join(lines) + "\n"


def run_sim_bench(out_dir: Path, des_requests: int, log: Callable[[str], None]) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    log("fidelity (offline runs in virtual time):")
    rows = fidelity(log)
    log(f"fleet DES speed ({des_requests:,} requests)...")
    des = des_speed(des_requests)
    log(f"  {des['cpu_s']:.1f} s CPU, {des['speedup_vs_real_time']:.1f}× real time")
    streams = []
    for interval in (8, 1):
        log(f"256 concurrent streams, stream interval {interval}...")
        s = stream_cpu(256, 256, interval, out_dir)
        log(
            f"  server {s['server_core_share']:.0%} of a core, "
            f"bare SSE {s['bare_sse_core_share']:.0%}"
        )
        streams.append(s)
    plot(rows, out_dir / "sim-fidelity.png")
    text = report(rows, des, streams, f"kvfleet bench sim --des-requests {des_requests}")
    (out_dir / "sim-fidelity.md").write_text(text)
    for name in ("sim-bench.log", "bare_sse.py"):
        (out_dir / name).unlink(missing_ok=True)
    return {"fidelity": rows, "des": des, "streams": streams}
