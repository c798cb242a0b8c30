"""The demo's live view: the cluster (pods, the InferenceService, its scaling Events, the
engines' own /metrics) read once a second, and the tables drawn from it."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from rich.console import Group
from rich.live import Live
from rich.table import Table

from kvfleet_bench.demo.live import WINDOW_S
from kvfleet_bench.demo.timeline import Decision, Run, TenantStats
from kvfleet_operator.render.common import COMPONENT_LABEL, ENGINE, GATEWAY, ROLE_LABEL
from kvfleet_operator.scaling.observe import parse_engine
from kvfleet_operator.status import pod_ready
from kvfleet_sim.fleet.collector import percentile

NS, NAME = "ai", "llama"
ISVC_PATH = f"/apis/kvfleet.dev/v1alpha1/namespaces/{NS}/inferenceservices"
PHASES = ("steady", "burst", "quiet")


BURST = (0.2, 0.55)
"""The burst phase, as shares of the run: 20% steady before it, 45% quiet after."""
RAMP = 0.5
"""The share of the burst its traffic takes to climb from the steady rate to its peak."""


def phase(t: float, duration: float) -> int:
    """20% steady, 35% burst, 45% quiet."""
    return 0 if t < BURST[0] * duration else (1 if t < BURST[1] * duration else 2)


def peak_at(duration: float) -> float:
    """When the burst's traffic reaches its peak (seconds since traffic began)."""
    return (BURST[0] + RAMP * (BURST[1] - BURST[0])) * duration


def burst_share(t: float, duration: float) -> float:
    """How far the traffic has climbed from the steady rate to the burst's (0..1): a ramp a
    forecast can see coming, then the peak; 0 outside the burst."""
    if phase(t, duration) != 1:
        return 0.0
    start = BURST[0] * duration
    return min(1.0, (t - start) / max(1e-9, peak_at(duration) - start))


@dataclass
class View:
    """The cluster as the live table shows it, refreshed once a second."""

    pods: list[dict[str, Any]] = field(default_factory=list)
    isvc: dict[str, Any] = field(default_factory=dict)
    engine_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    seen_events: set[str] = field(default_factory=set)

    def engines(self) -> list[dict[str, Any]]:
        return [p for p in self.pods if _label(p, COMPONENT_LABEL) == ENGINE]

    def gateway_url(self) -> str | None:
        for p in self.pods:
            if _label(p, COMPONENT_LABEL) == GATEWAY and pod_ready(p):
                return f"http://{p['status']['podIP']}:8080"
        return None

    def count(self, role: str) -> int:
        return sum(
            1 for p in self.engines() if pod_ready(p) and _role(p) == role and not _leaving(p)
        )


def _label(pod: dict[str, Any], name: str) -> str:
    return str((pod["metadata"].get("labels") or {}).get(name, "-"))


def _role(pod: dict[str, Any]) -> str:
    return _label(pod, ROLE_LABEL)


def _leaving(pod: dict[str, Any]) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


async def _scrape(session: aiohttp.ClientSession, ip: str) -> dict[str, float]:
    try:
        async with session.get(f"http://{ip}:30000/metrics") as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return {}
    m = parse_engine(text, time.time())
    values = {"queue": m.queue, "running": m.running, "kv": m.kv_usage} if m else {}
    for line in text.splitlines():
        for gauge in ("gen_throughput", "cache_hit_rate"):
            if line.startswith((f"sglang:{gauge}", f"sglang_{gauge}")):
                values[gauge] = float(line.rsplit(" ", 1)[1])
    return values


async def refresh(
    view: View,
    api: aiohttp.ClientSession,
    scraper: aiohttp.ClientSession,
    url: str,
    run_: Run,
    t: float,
) -> None:
    """The cluster's state from the API server (`api`), the engines' from their /metrics
    (`scraper`: one session for the whole run, with a short timeout)."""
    async with api.get(f"{url}/api/v1/namespaces/{NS}/pods") as r:
        view.pods = sorted((await r.json()).get("items") or [], key=lambda p: p["metadata"]["name"])
    async with api.get(f"{url}{ISVC_PATH}/{NAME}") as r:
        view.isvc = await r.json() if r.status == 200 else {}
    async with api.get(f"{url}/api/v1/namespaces/{NS}/events") as r:
        events = (await r.json()).get("items") or []
    for e in sorted(events, key=lambda e: int(e["metadata"]["resourceVersion"])):
        uid = e["metadata"]["uid"]
        if uid not in view.seen_events and e.get("reason") in ("ScaledUp", "ScaledDown"):
            run_.decisions.append(Decision(t, f"{e['reason']}: {e.get('message', '')}"))
        view.seen_events.add(uid)
    for p in view.engines():
        name, role = p["metadata"]["name"], _role(p)
        if t > 0 and view.roles.get(name) == "warm" and role == "active":  # not at start-up
            run_.promoted.append(name)
            run_.decisions.append(Decision(t, f"promoted {name} (warm → active)"))
        view.roles[name] = role
    ready = [p for p in view.engines() if pod_ready(p)]
    scraped = await asyncio.gather(*(_scrape(scraper, p["status"]["podIP"]) for p in ready))
    view.engine_metrics = {p["metadata"]["name"]: m for p, m in zip(ready, scraped, strict=True)}


def render(
    view: View, stats: dict[str, TenantStats], run_: Run, t: float, duration: float, src: str
) -> Group:
    status = view.isvc.get("status") or {}
    auto = status.get("autoscaling") or {}
    ready: dict[str, Any] = next(
        (c for c in status.get("conditions") or [] if c["type"] == "Ready"), {}
    )
    head = Table(
        title=f"InferenceService {NS}/{NAME} · t = {t:5.1f} of {duration:.0f} s · "
        f"phase: {PHASES[phase(t, duration)] if t > 0 else 'starting'} · "
        f"signals: {src}",
        expand=True,
    )
    for col in ("active", "warm", "desired active/warm", "Ready", "last decision"):
        head.add_column(col)
    head.add_row(
        str(view.count("active")),
        str(view.count("warm")),
        desired_text(view.isvc),
        f"{ready.get('status', '-')} ({ready.get('reason', '-')})",
        (auto.get("reason") or "-")[:90],
    )
    reps = Table(title="engine replicas (their /metrics)", expand=True)
    reps.add_column("pod", no_wrap=True)
    for col in ("role", "ready", "queue", "running", "KV", "hit rate", "tokens/s"):
        reps.add_column(col, justify="right")
    for p in view.engines():
        m = view.engine_metrics.get(p["metadata"]["name"], {})
        reps.add_row(
            p["metadata"]["name"],
            _role(p) + (" (leaving)" if _leaving(p) else ""),
            "yes" if pod_ready(p) else "loading",
            f"{m['queue']:g}" if "queue" in m else "-",
            f"{m['running']:g}" if "running" in m else "-",
            f"{m['kv']:.0%}" if "kv" in m else "-",
            f"{m['cache_hit_rate']:.0%}" if "cache_hit_rate" in m else "-",
            f"{m['gen_throughput']:,.0f}" if "gen_throughput" in m else "-",
        )
    now = time.monotonic()
    traffic = Table(title="tenants, through the gateway (OpenAI SDK)", expand=True)
    traffic.add_column("tenant", no_wrap=True)
    last = f"(last {WINDOW_S:.0f} s)"
    for col in ("sent", "ok", f"TTFT p50 {last}", f"TTFT p99 {last}", f"tok/s {last}",
                "429 by reason", "budget"):  # fmt: skip
        traffic.add_column(col, justify="right")
    for name, s in stats.items():
        ttft = s.window_ttft(now, WINDOW_S)
        traffic.add_row(
            name,
            str(s.sent),
            str(s.ok),
            f"{percentile(ttft, 50) * 1000:,.0f} ms" if ttft else "-",
            f"{percentile(ttft, 99) * 1000:,.0f} ms" if ttft else "-",
            f"{s.tokens_per_s(now, WINDOW_S):,.0f}",
            ", ".join(f"{k} {v}" for k, v in s.refused.items()) or "-",
            f"{s.billed_tokens:,}/{s.budget:,}" if s.budget else "-",
        )
    decisions = Table(title="scaling decisions", expand=True)
    decisions.add_column("t", justify="right")
    decisions.add_column("decision")
    for d in run_.decisions[-6:]:
        decisions.add_row(f"{d.t:5.1f}", d.what[:120])
    return Group(head, reps, traffic, decisions)


class Progress(Protocol):
    """Where the demo shows its state each refresh: a live table on a terminal, plain lines
    elsewhere (a CI log, a pipe), where a table cut at 80 columns helps no one."""

    def show(
        self, view: View, stats: dict[str, TenantStats], run_: Run, t: float, src: str
    ) -> None: ...


@dataclass
class LiveTables:
    live: Live
    duration: float

    def show(
        self, view: View, stats: dict[str, TenantStats], run_: Run, t: float, src: str
    ) -> None:
        self.live.update(render(view, stats, run_, t, self.duration, src))


@dataclass
class PlainLines:
    duration: float
    every_s: float = 5.0
    """A status line this often; each scaling decision as it happens."""
    echo: Callable[[str], None] = field(default=lambda line: print(line, flush=True))
    _decisions: int = 0
    _last: float | None = None

    def show(
        self, view: View, stats: dict[str, TenantStats], run_: Run, t: float, src: str
    ) -> None:
        if self._last is None:
            self.echo(f"signals from {src}")
        for d in run_.decisions[self._decisions :]:
            self.echo(f"t={d.t:6.1f}s  {d.what}")
        self._decisions = len(run_.decisions)
        if self._last is not None and t - self._last < self.every_s:
            return
        self._last = t
        ttft = [v for s in stats.values() for v in s.window_ttft(time.monotonic(), WINDOW_S)]
        p50 = f"{percentile(ttft, 50) * 1000:,.0f} ms" if ttft else "-"
        refused = sum(sum(s.refused.values()) for s in stats.values())
        self.echo(
            f"t={t:6.1f}s  {PHASES[phase(t, self.duration)] if t > 0 else 'starting':8} "
            f"active {view.count('active')} warm {view.count('warm')} "
            f"(desired {desired_text(view.isvc)})  "
            f"queue {sum(m.get('queue', 0.0) for m in view.engine_metrics.values()):g}  "
            f"TTFT p50 (last {WINDOW_S:.0f} s) {p50}  "
            f"served {sum(s.ok for s in stats.values())}  429 {refused}"
        )


def desired_text(isvc: dict[str, Any]) -> str:
    """The decided active/warm, and why the spare is missing when maxReplicas leaves no
    room for it (warm replicas count inside it): `3/0 (no spare: at maxReplicas)`."""
    bounds = (isvc.get("spec") or {}).get("autoscaling") or {}
    auto = (isvc.get("status") or {}).get("autoscaling") or {}
    active, warm = auto.get("desiredActive"), auto.get("desiredWarm")
    text = f"{'-' if active is None else active}/{'-' if warm is None else warm}"
    want, top = int(bounds.get("warmReplicas") or 0), int(bounds.get("maxReplicas") or 0)
    if active is not None and warm is not None and warm < want and active + want > top:
        text += " (no spare: at maxReplicas)"
    return text


def on_a_terminal() -> bool:
    return sys.stdout.isatty()
