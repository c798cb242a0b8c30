"""`kvfleet demo` in its three forms: the autoscaler on the local cluster (`make demo`), the
stack without Kubernetes, and the fleet simulator."""

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from kvfleet_bench.demo.fleet import run_demo
from kvfleet_bench.demo.stack import run_stack_demo
from kvfleet_localcluster.controlplane_gomod import KUBERNETES_VERSION
from tests.support.cluster import require_control_plane


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


@pytest.mark.parametrize("duration", ["0.1", "0.5"])
def test_a_simulated_fleet_too_short_to_finish_a_request_says_so(
    tmp_path: Path, duration: str
) -> None:
    """`--duration 0.5` on one replica simulates 2 s, and no request (a prefill and 128
    tokens) finished in them: the summary of nothing raised a ValueError, a traceback. A
    short run now either shows its summary or says what to give instead, exit code 1."""
    kvfleet = Path(sys.executable).parent / "kvfleet"
    done = subprocess.run(
        [str(kvfleet), "demo", "--simulated-fleet", "--duration", duration, "--replicas", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**os.environ, "TERM": "dumb"},
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    if done.returncode == 0:
        assert "the whole run" in done.stdout
    else:
        assert done.returncode == 1
        assert "no request finished in the" in done.stderr
        assert "give a longer --duration" in done.stderr


@pytest.mark.parametrize("form", ["--stack", "--simulated-fleet"])
def test_on_a_pipe_the_last_frame_ends_before_the_whole_runs_summary(
    tmp_path: Path, form: str
) -> None:
    """Into a pipe, rich's live view writes its last frame without ending its bottom border's
    line: the summary ran into it (`└────┘doc-search: 9/9 served`). And the last frame's TTFT
    (its last 10 s) and the summary's (the whole run) differ: each says which it is."""
    kvfleet = Path(sys.executable).parent / "kvfleet"
    done = subprocess.run(
        [str(kvfleet), "demo", form, "--duration", "3", "--replicas", "1"], cwd=tmp_path,
        capture_output=True, text=True, timeout=120, env={**os.environ, "TERM": "dumb"},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    lines = done.stdout.splitlines()
    border = max(i for i, line in enumerate(lines) if line.startswith("└"))
    assert set(lines[border]) <= set("└┴─┘"), lines[border]
    assert lines[border + 1] == "" and lines[border + 2].startswith("the whole run"), lines
    assert "(last" in "\n".join(lines[:border])  # the live columns say their window


@pytest.mark.timeout(360)
def test_the_autoscaler_demo_shows_what_it_promises(tmp_path: Path) -> None:
    """`make demo` as a user types it, shortened (`--quick`): the `kvfleet` command in a
    fresh directory with the default, relative `--out` — the local cluster on the real
    Kubernetes control plane, the real operator, Prometheus (when installed) and Redis (when
    installed). It exits 0 only when every check holds; the report lands where the user is.
    (An absolute `--out` hid that Prometheus resolved the relative file_sd path against its
    config's folder and scraped nothing.)"""
    require_control_plane()
    kvfleet = Path(sys.executable).parent / "kvfleet"
    done = subprocess.run(
        [str(kvfleet), "demo", "--quick"], cwd=tmp_path, capture_output=True, text=True,
        timeout=340, env={**os.environ, "TERM": "dumb"},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    # The real API server, not an emulation: it reports the release the cluster is built at.
    assert f"on Kubernetes {KUBERNETES_VERSION} (local: h100-1: 8×" in done.stdout
    # Not on a terminal: plain progress lines and each decision, not a table cut at 80 columns.
    assert "┌" not in done.stdout and "t=" in done.stdout and "ScaledUp" in done.stdout
    out = tmp_path / "kvfleet-demo"
    assert (out / "timeline.png").stat().st_size > 10_000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"], summary["checks"]
    assert summary["cluster"]["kubernetes"] == f"Kubernetes {KUBERNETES_VERSION}"
    assert summary["tenants"]["trial"]["refused"]["insufficient_quota"] > 0
    assert summary["tenants"]["support-chat"]["failed"] == {}
    if shutil.which("prometheus"):
        assert summary["metrics_source"].startswith("Prometheus")


async def test_a_demo_whose_prometheus_scrapes_nothing_says_so_at_once(
    prometheus: Callable[[list[str]], str],
) -> None:
    """Prometheus up but with no live target (what a wrong file_sd path gives): the demo
    stops within seconds, naming the count, instead of two minutes of an autoscaler holding."""
    from kvfleet_bench.demo.autoscaler import SignalsUnavailable, require_scraped_targets
    from kvfleet_sim.procs import free_port

    url = prometheus([f"127.0.0.1:{free_port()}"])  # nothing listens there
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        with pytest.raises(SignalsUnavailable, match=r"has [01] active targets .*\(0 up\)"):
            await require_scraped_targets(session, url, engines=2, within_s=3.0)
    assert time.monotonic() - started < 6.0
