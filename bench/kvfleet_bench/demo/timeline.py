"""What `kvfleet demo` records, once a second, and what it makes of it at the end: the
checks it exits on, a summary, and a PNG timeline (replicas by role, latency and queue,
throughput and refusals, each scaling decision marked)."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvfleet_sim.fleet.collector import percentile


@dataclass
class TenantStats:
    """What one tenant's client saw."""

    budget: int | None = None
    sent: int = 0
    ok: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    """Refusals by the gateway's error code (insufficient_quota, rate_limit_exceeded, ...)."""
    failed: dict[str, int] = field(default_factory=dict)
    """Anything else: errors that are not a limit saying no."""
    billed_by_period: dict[int, int] = field(default_factory=dict)
    """prompt + completion tokens of the usage the gateway reported on served requests, by the
    budget period each request was admitted in (the Unix time it ends, from
    `x-kvfleet-budget-resets-at`; 0 when the gateway sent none): a daily budget starts again
    at midnight UTC, even in the middle of a demo."""

    @property
    def billed_tokens(self) -> int:
        return sum(self.billed_by_period.values())

    def bill(self, tokens: int, resets_at: int) -> None:
        self.billed_by_period[resets_at] = self.billed_by_period.get(resets_at, 0) + tokens

    def most_in_one_period(self) -> int:
        return max(self.billed_by_period.values(), default=0)

    ttft: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=5000))
    """(monotonic time of the first token, seconds to it)."""
    tokens: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=20000))
    """(monotonic finish time, completion tokens)."""

    def window_ttft(self, now: float, window_s: float) -> list[float]:
        return [v for at, v in self.ttft if now - at <= window_s]

    def tokens_per_s(self, now: float, window_s: float) -> float:
        return sum(n for at, n in self.tokens if now - at <= window_s) / window_s


@dataclass(frozen=True)
class Sample:
    t: float
    """Seconds since traffic began."""
    active: int
    warm: int
    desired_active: int | None
    queue: float
    ttft_p50: float | None
    ttft_p99: float | None
    tokens_per_s: float
    ok: int
    refused: int


@dataclass(frozen=True)
class Decision:
    t: float
    what: str
    """e.g. `ScaledUp: queue 9 over 1 active ...` or `promoted llama-engine-x (warm → active)`."""


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    promoted: list[str] = field(default_factory=list)
    max_desired: int = 0
    final_desired: int | None = None
    min_replicas: int = 1
    burst: tuple[float, float] | None = None
    """When the burst phase ran (seconds since traffic began), shaded in the plot."""
    peak_at: float | None = None
    """When the burst's traffic reached its peak (capacity is due before it)."""

    def scale_ups(self) -> list[Decision]:
        return [d for d in self.decisions if d.what.startswith("ScaledUp")]

    def checks(self, tenants: dict[str, TenantStats]) -> dict[str, tuple[bool, str]]:
        """What the demo must show, each with the evidence (exit 0 only if all hold)."""
        served = sum(s.ok for s in tenants.values())
        failed = sum(sum(s.failed.values()) for s in tenants.values())
        budgeted = {n: s for n, s in tenants.items() if s.budget is not None}
        over = {n: s for n, s in budgeted.items() if s.most_in_one_period() > (s.budget or 0)}
        exhausted = [n for n, s in budgeted.items() if s.refused.get("insufficient_quota")]
        ups = self.scale_ups()
        return {
            "requests served": (served > 0, f"{served} served, {failed} failed"),
            "a warm replica promoted": (
                bool(self.promoted),
                ", ".join(self.promoted) or "no warm pod turned active",
            ),
            "the fleet scaled up": (
                bool(ups) and self.max_desired > self.min_replicas,
                f"{len(ups)} ScaledUp decisions, up to {self.max_desired} active",
            ),
            "and back down": (
                self.final_desired is not None and self.final_desired <= self.min_replicas,
                f"{self.final_desired} active at the end (minimum {self.min_replicas})",
            ),
            "the budget held": (
                bool(exhausted) and not over,
                "; ".join(_budget_evidence(n, s) for n, s in budgeted.items()),
            ),
        }


def _ahead_of(run: Run, ups: list[Decision]) -> tuple[bool, str]:
    """The replicas the burst needed (the most active it asked for during it) were ready —
    active or warm — before its traffic peaked: capacity ahead of the load, not after it;
    with the first scale-up and the term that ordered it (forecast, queue, KV...)."""
    if run.burst is None or run.peak_at is None or not ups:
        return False, "no scale-up"
    start, end = run.burst
    wanted = [s.desired_active or 0 for s in run.samples if start <= s.t < end]
    need = max(wanted, default=0)
    ready = next((s.t for s in run.samples if s.active + s.warm >= need), None)
    first = f"first ScaledUp at {ups[0].t:.1f} s: {ups[0].what[:80]}"
    if need <= run.min_replicas or ready is None:
        return False, f"the burst asked for {need} active, never ready; {first}"
    when = run.peak_at - ready
    side = f"{when:.1f} s before" if when > 0 else f"{-when:.1f} s after"
    return when > 0, f"{need} replicas ready at {ready:.1f} s, {side} the peak; {first}"


def _budget_evidence(name: str, s: TenantStats) -> str:
    refused = f"{s.refused.get('insufficient_quota', 0)} refused insufficient_quota"
    if len(s.billed_by_period) <= 1:
        return f"{name}: {s.billed_tokens:,} of {s.budget or 0:,} tokens billed, {refused}"
    each = " and ".join(f"{v:,}" for _, v in sorted(s.billed_by_period.items()))
    return (
        f"{name}: {s.billed_tokens:,} tokens billed over {len(s.billed_by_period)} budget "
        f"periods ({each} of {s.budget or 0:,}), {refused}"
    )


def summary(run: Run, tenants: dict[str, TenantStats], source: str) -> dict[str, Any]:
    checks = run.checks(tenants)
    ahead = _ahead_of(run, run.scale_ups())
    per_tenant = {}
    for name, s in tenants.items():
        ttft = [v for _, v in s.ttft]
        per_tenant[name] = {
            "sent": s.sent,
            "ok": s.ok,
            "refused": dict(s.refused),
            "failed": dict(s.failed),
            "billed_tokens": s.billed_tokens,
            "billed_by_period": {str(k): v for k, v in sorted(s.billed_by_period.items())},
            "budget": s.budget,
            "ttft_p50_ms": round(percentile(ttft, 50) * 1000) if ttft else None,
            "ttft_p99_ms": round(percentile(ttft, 99) * 1000) if ttft else None,
        }
    return {
        "metrics_source": source,
        "passed": all(ok for ok, _ in checks.values()),
        "checks": {k: {"ok": ok, "evidence": why} for k, (ok, why) in checks.items()},
        # Reported, not a check: the quick run's ramp (5 s) is shorter than a scale-up.
        "burst_replicas_ready_before_peak": dict(zip(("ok", "evidence"), ahead, strict=True)),
        "tenants": per_tenant,
        "decisions": [asdict(d) for d in run.decisions],
        "samples": [asdict(s) for s in run.samples],
    }


def write_report(out: Path, doc: dict[str, Any], run: Run) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(doc, indent=2))
    paths = [out / "summary.json"]
    png = plot(run, out / "timeline.png")
    if png is not None:
        paths.append(png)
    return paths


UP, DOWN = "#2f855a", "#9b2c2c"
"""Decision lines: scale-up or promotion, and scale-down."""
BURST, BURST_EDGE = "#edf2f7", "#a0aec0"
"""The burst phase: shading behind the data, and its band along each panel's top."""


def _legend(ax: Any, twin: Any, run: Run) -> None:
    """One legend per panel with every series of both its axes, the burst and the decisions
    (a line on the twin axis or an unlabelled span is otherwise missing from it)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles, labels = ax.get_legend_handles_labels()
    if twin is not None:
        more, more_labels = twin.get_legend_handles_labels()
        handles, labels = handles + more, labels + more_labels
    if run.burst is not None:
        handles.append(Patch(facecolor=BURST, edgecolor=BURST_EDGE))
        labels.append("burst phase")
    if run.decisions:
        handles += [Line2D([], [], color=UP, alpha=0.6), Line2D([], [], color=DOWN, alpha=0.6)]
        labels += ["scale up / warm promoted", "scale down"]
    ax.legend(handles, labels, loc="upper left", fontsize=7, ncols=2, framealpha=0.9)


def plot(run: Run, path: Path) -> Path | None:
    if not run.samples:
        return None
    import matplotlib.pyplot as plt

    fig = figure(run)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure(run: Run) -> Any:
    """The timeline's three panels (replicas; TTFT and queue; tokens/s and refusals)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    t = [s.t for s in run.samples]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True)
    ax1.stackplot(
        t,
        [s.active for s in run.samples],
        [s.warm for s in run.samples],
        labels=["active (serving)", "warm (loaded spare)"],
        colors=["#2b6cb0", "#f6ad55"],
        step="post",
    )
    ax1.step(
        t,
        [s.desired_active or 0 for s in run.samples],
        where="post",
        color="black",
        linestyle="--",
        label="desired active",
    )
    ax1.set_ylabel("engine replicas")
    ax1.yaxis.set_major_locator(MaxNLocator(integer=True))  # no half replicas
    ax2.plot(t, [(s.ttft_p50 or 0) * 1000 for s in run.samples], label="TTFT p50 (10 s)")
    ax2.plot(t, [(s.ttft_p99 or 0) * 1000 for s in run.samples], label="TTFT p99 (10 s)")
    ax2.set_ylabel("ms")
    ax2b = ax2.twinx()
    ax2b.plot(t, [s.queue for s in run.samples], color="grey", alpha=0.6, label="queued (right)")
    ax2b.set_ylabel("queued requests")
    ax3.plot(t, [s.tokens_per_s for s in run.samples], label="output tokens/s")
    ax3.set_ylabel("tokens/s")
    ax3b = ax3.twinx()
    refused = [b.refused - a.refused for a, b in zip(run.samples, run.samples[1:], strict=False)]
    ax3b.bar(t[1:], refused, width=0.8, color="#c53030", alpha=0.5, label="429/s (right)")
    ax3b.set_ylabel("refused (429) per s")
    ax3b.set_ylim(bottom=0)
    ax3.set_xlabel("seconds since traffic began")
    for ax in (ax1, ax2, ax3):
        if run.burst is not None:
            # Behind the data, and a band along the top over it: the replica panel's filled
            # areas hid the shading beneath them.
            ax.axvspan(*run.burst, color=BURST, zorder=0)
            ax.axvspan(*run.burst, ymin=0.96, color=BURST_EDGE, zorder=4, linewidth=0)
    for d in run.decisions:
        for ax in (ax1, ax2, ax3):
            ax.axvline(d.t, color=UP if "Up" in d.what or "promoted" in d.what else DOWN,
                       alpha=0.35, linewidth=1)  # fmt: skip
    _legend(ax1, None, run)
    _legend(ax2, ax2b, run)
    _legend(ax3, ax3b, run)
    fig.suptitle("kvfleet demo: the autoscaler under three tenants' bursty traffic")
    fig.tight_layout()
    return fig
