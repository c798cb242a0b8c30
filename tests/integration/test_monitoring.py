"""The dashboard's and the alerts' PromQL against a real Prometheus scraping a real
(simulated) engine with the labels the PodMonitor adds: every query parses, and the engine
panels return series."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.conftest import SimFactory

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "manifests" / "monitoring"
LABELS = {"namespace": "ai", "inferenceservice": "llama", "role": "active", "pod": "llama-engine-0"}


def queries() -> tuple[list[str], list[str]]:
    dashboard = json.loads((MONITORING / "kvfleet-dashboard.json").read_text())
    panel_exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rule = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    alert_exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    return panel_exprs, alert_exprs


async def query(s: aiohttp.ClientSession, url: str, expr: str) -> dict[str, Any]:
    variables = {"$namespace": "ai", "$inferenceservice": "llama"}
    for k, v in variables.items():
        expr = expr.replace(k, v)
    async with s.get(f"{url}/api/v1/query", params={"query": expr}) as r:
        body: dict[str, Any] = await r.json()
        assert r.status == 200 and body["status"] == "success", (expr, body)
        return body


async def test_dashboard_and_alert_queries_run_on_real_prometheus(
    sim_server: SimFactory, prometheus: Callable[..., str]
) -> None:
    engine = await sim_server()
    target = engine.removeprefix("http://")
    prom = prometheus([target], LABELS)
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{engine}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}}
        ) as r:
            assert r.status == 200
        for _ in range(100):  # first scrape after a few seconds
            got = await query(
                s, prom, '{__name__=~"sglang[:_]num_queue_reqs", inferenceservice="llama"}'
            )
            if got["data"]["result"]:
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("Prometheus never scraped the engine")
        panels, alerts = queries()
        assert len(panels) >= 12 and len(alerts) >= 4
        for expr in alerts:
            await query(s, prom, expr)
        engine_gauges = [e for e in panels if "sglang" in e and "rate(" not in e]
        assert len(engine_gauges) >= 4
        for expr in panels:
            body = await query(s, prom, expr)
            if expr in engine_gauges:
                assert body["data"]["result"], f"no series for {expr}"
        by_role = await query(s, prom, next(e for e in panels if "count by (role)" in e))
        assert by_role["data"]["result"][0]["metric"] == {"role": "active"}


async def test_kvfleet_usage_reads_the_gateway_from_prometheus(
    sim_server: SimFactory, prometheus: Callable[..., str], gateway_server: Any, tmp_path: Path
) -> None:
    """`kvfleet usage --prometheus-url`: the gateway's counters, scraped with the labels its
    PodMonitor adds, summed per tenant over the window with increase()."""
    from kvfleet_cli.usage_cmds import _from_prometheus, aggregate
    from tests.integration.test_gateway_abuse import CANARY, chat, keys, post
    from tests.support.gateway import gateway_config, metrics_url

    engine = await sim_server()
    cfg = gateway_config([engine], keys(tmp_path))
    gw = await gateway_server(cfg)
    target = metrics_url(cfg).removeprefix("http://").removesuffix("/metrics")
    prom = prometheus([target], {"namespace": "ai", "inferenceservice": "llama"})
    assert (await post(gw, chat(max_tokens=5), key=CANARY))[0] == 200
    async with aiohttp.ClientSession() as s:
        for _ in range(100):  # the counters exist in Prometheus: now they can increase
            got = await query(s, prom, 'kvfleet_gateway_requests_total{inferenceservice="llama"}')
            if got["data"]["result"]:
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("Prometheus never scraped the gateway")
    # A few more 1 s scrapes before the three requests: increase() extrapolates a series by
    # up to 1.1 scrape intervals at each end, so the ~1.6x bound below needs the series to
    # span at least ~4 s (read 3 s after its first sample it spanned less: 5.01 requests).
    await asyncio.sleep(3.0)
    for _ in range(3):
        assert (await post(gw, chat(max_tokens=5), key=CANARY))[0] == 200
    usage: Any = {}
    for _ in range(50):  # until a scrape after the three requests
        samples, source = await asyncio.to_thread(
            _from_prometheus, prom, "ai", "llama", "5m", "inferenceservice"
        )
        usage = aggregate(samples)
        if usage and usage["t"].requests.get("200", 0) >= 2.9:
            break
        await asyncio.sleep(0.2)
    assert source == "Prometheus, last 5m"
    u = usage["t"]
    # increase() extrapolates to the window's edges (up to about half a scrape interval on
    # each side of a short series): 3 requests and 15 tokens read as up to ~1.6x that.
    assert 2.9 <= u.requests["200"] <= 5.0, u
    assert 14 <= u.tokens["completion"] <= 25, u
    assert u.budget_left is not None and u.budget_left < 5_000
    # Per tenant and model (what a shared gateway's usage is read by): the same counts.
    by_model = aggregate(samples, by_model=True)
    assert set(by_model) == {"t × llama-3.1-8b"}
    assert by_model["t × llama-3.1-8b"].requests == u.requests
