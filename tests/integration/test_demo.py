"""`kvfleet demo` in its three forms: the autoscaler on the local cluster (`make demo`), the
stack without Kubernetes, and the fleet simulator."""

import json
import shutil
from pathlib import Path

from kvfleet_bench.demo.fleet import run_demo
from kvfleet_bench.demo.stack import run_stack_demo


def test_live_stack_demo_serves_both_tenants(tmp_path: Path) -> None:
    summary = run_stack_demo(4.0, tmp_path)
    chat, search = summary["support-chat"], summary["doc-search"]
    assert chat["ok"] > 20 and chat["ok"] == chat["sent"]
    assert chat["cache_hit_rate"] > 0.5  # the shared system prompt is routed to its cache
    assert search["ok"] > 0
    assert (tmp_path / "gateway.log").exists()


def test_simulated_fleet_demo_reports_a_summary() -> None:
    summary = run_demo(1.0, replicas=2)
    assert summary["requests"] > 0 and summary["ttft_p50"] > 0


def test_the_autoscaler_demo_shows_what_it_promises(tmp_path: Path) -> None:
    """`make demo`, shortened: the local cluster, the real operator, Prometheus (when
    installed) and Redis (when installed); every check the demo exits on holds, and the
    report is written."""
    from kvfleet_bench.demo.autoscaler import quick_config, run_autoscaler_demo

    doc = run_autoscaler_demo(quick_config(tmp_path / "out"))
    failed = {k: c["evidence"] for k, c in doc["checks"].items() if not c["ok"]}
    assert doc["passed"], failed
    assert (tmp_path / "out" / "timeline.png").stat().st_size > 10_000
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["tenants"]["trial"]["refused"]["insufficient_quota"] > 0
    assert summary["tenants"]["support-chat"]["failed"] == {}
    if shutil.which("prometheus"):
        assert summary["metrics_source"].startswith("Prometheus")
