"""`kvfleet demo` runs the real stack end to end (engines + gateway + tenants) and cleans up."""

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


def test_cluster_demo_scales_and_heals_without_losing_requests(tmp_path: Path) -> None:
    from kvfleet_bench.demo.on_cluster import run_cluster_demo

    result = run_cluster_demo(8.0, tmp_path)
    assert result["sent"] > 20 and result["ok"] == result["sent"], result["failed"]
    assert result["ready_replicas"] == 3
    assert len([p for p in result["pods"] if "-engine-" in p]) == 3
    assert {"Created", "Serving", "Updated"} <= set(result["events"])
