"""`kvfleet bench cluster`, shortened, end to end on the real control plane: the throughput
run against kube-apiserver beside its bare-TLS baseline, and a scale run whose operator's
requests the API server itself counts (the bench's FlowSchemas) — none of them writes once
the fleet is steady."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet_bench.cluster_report import report
from kvfleet_bench.cluster_scale import scale_run, throughput_runs
from kvfleet_localcluster.controlplane_gomod import KUBERNETES_VERSION
from tests.support.cluster import require_control_plane


@pytest.mark.timeout(900)
def test_the_cluster_bench_runs_on_the_real_control_plane(tmp_path: Path) -> None:
    require_control_plane()
    said: list[str] = []
    (tmp_path / "tp").mkdir()
    (tmp_path / "scale").mkdir()
    tp = throughput_runs(tmp_path / "tp", runs=1, seconds=0.5, say=said.append)
    assert tp["apiserver"][0].rps > 0 and tp["apiserver"][0].per_cpu_s > 0
    assert tp["baseline"][0].rps > 0
    run = scale_run(tmp_path / "scale", 3, 3.0, said.append, resync_s=1.0, gateways=1)
    assert run.ready_s > 0 and run.requests > run.operator_requests > 0
    assert run.steady_operator_writes == 0 and run.steady_events == 0
    text = report(tp, run, run)
    assert f"kube-apiserver {KUBERNETES_VERSION}" in text and "emulated" not in text
