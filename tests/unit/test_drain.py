"""An engine pod's preStop drain: the hook the operator renders (python3 running the drain
script, bounded by the grace period), and the script itself, run as the kubelet runs it,
against a /metrics that empties, never empties, or is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvfleet_operator.render import owner_of, render_children
from kvfleet_operator.render.drain_script import in_flight
from kvfleet_operator.render.engine import DRAIN_SCRIPT, drain_hook
from kvfleet_sim.procs import free_port
from tests.support.objects import isvc

HELP = (
    "# HELP sglang:num_running_reqs The number of running requests.\n"
    "# TYPE sglang:num_running_reqs gauge\n"
)


def exposition(running: float, queued: float) -> str:
    """What SGLang's /metrics says (its names, labels and float formatting)."""
    labels = 'engine_type="unified",model_name="llama-3.1-8b",pp_rank="0",tp_rank="0"'
    return (
        f"{HELP}sglang:num_running_reqs{{{labels}}} {running:.1f}\n"
        f"sglang:num_queue_reqs{{{labels}}} {queued:.1f}\n"
        f"sglang:num_running_reqs_offline_batch{{{labels}}} 7.0\n"
        f"sglang:token_usage{{{labels}}} 0.25\n"
    )


def _engine_pod(**engine: Any) -> dict[str, Any]:
    doc = isvc(engine={"gpuType": "h100", **engine})
    doc["metadata"]["uid"] = "5f0c2b9e-0000-4000-8000-000000000009"
    (dep,) = [
        o
        for o in render_children(owner_of(doc))
        if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-engine")
    ]
    return dep["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def test_the_engine_drains_within_its_grace_period() -> None:
    pod = _engine_pod()
    (c,) = pod["containers"]
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    # The image's python3 runs the script: 10 s for routing to stop, then until the engine at
    # :30000 is idle, giving up 5 s before the kubelet's SIGKILL at the 120 s grace period.
    assert command == ["python3", "-c", DRAIN_SCRIPT, "30000", "10", "115"]
    assert pod["terminationGracePeriodSeconds"] == 120
    compile(DRAIN_SCRIPT, "<preStop>", "exec")
    long = _engine_pod(terminationGracePeriodSeconds=900)
    assert long["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][3:] == [
        "30000",
        "10",
        "895",
    ]


def test_a_short_grace_period_shortens_the_wait_for_routing_too() -> None:
    assert drain_hook(5)["exec"]["command"][3:] == ["30000", "4", "4"]
    assert drain_hook(12)["exec"]["command"][3:] == ["30000", "9.6", "9.6"]
    assert drain_hook(20, "LEADER")["exec"]["command"][3:] == ["30000", "10", "16", "LEADER"]


def test_requests_in_flight_are_running_plus_queued_over_every_series() -> None:
    assert in_flight(exposition(2, 3)) == 5
    assert in_flight(exposition(0, 0)) == 0
    two_ranks = exposition(1, 0) + exposition(0, 4).replace('tp_rank="0"', 'tp_rank="1"')
    assert in_flight(two_ranks) == 5
    assert in_flight("sglang:num_queue_reqs 2\n") == 2  # no labels
    assert in_flight("sglang:token_usage 0.5\n# sglang:num_running_reqs 3\n") is None


class FakeEngine:
    """A /metrics whose running requests (2) end at `idle_at` (monotonic; None: never)."""

    def __init__(self, idle_at: float | None) -> None:
        self.idle_at = idle_at
        self.scrapes: list[float] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                now = time.monotonic()
                engine.scrapes.append(now)
                idle = engine.idle_at is not None and now >= engine.idle_at
                body = exposition(0 if idle else 2, 0).encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    made: list[FakeEngine] = []
    yield made
    for e in made:
        e.close()


def run_drain(port: int, delay_s: float, bound_s: float, **env: str) -> tuple[float, float, str]:
    """The script as the hook runs it (`python3 -c SCRIPT ...`, the engine at 127.0.0.1):
    when it started, its wall time and what it said."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", DRAIN_SCRIPT, str(port), str(delay_s), str(bound_s), "ENGINE"],
        env={**os.environ, "ENGINE": "127.0.0.1", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return started, time.monotonic() - started, done.stderr


def test_the_drain_waits_until_the_engine_is_idle(engines: list[FakeEngine]) -> None:
    engine = FakeEngine(idle_at=time.monotonic() + 2.0)
    engines.append(engine)
    started, took, said = run_drain(engine.port, 0.3, 20)
    assert 2.0 <= took < 4.5, said
    assert "drain: no requests in flight" in said
    # Nothing polled during the wait for routing; then once a second until idle.
    assert engine.scrapes[0] - started >= 0.3
    assert 2 <= len(engine.scrapes) <= 4


def test_the_drain_gives_up_at_its_bound(engines: list[FakeEngine]) -> None:
    engine = FakeEngine(idle_at=None)
    engines.append(engine)
    _, took, said = run_drain(engine.port, 0.2, 2.5)
    assert 2.5 <= took < 4.0, said
    assert "bound of 2.5s reached with 2 requests in flight" in said


def test_a_gone_engine_ends_the_drain_at_once() -> None:
    _, took, said = run_drain(free_port(), 0.2, 20)
    assert 0.2 <= took < 1.5, said
    assert "engine unreachable" in said


def test_a_fast_node_clock_scales_the_fixed_waits(engines: list[FakeEngine]) -> None:
    """The local cluster's node clock (KVFLEET_NODE_TIME_SCALE) scales the wait for routing
    and the bound, as it scales the grace period: 10 s and 40 s at 0.05 are 0.5 s and 2 s."""
    engine = FakeEngine(idle_at=None)
    engines.append(engine)
    started, took, said = run_drain(engine.port, 10, 40, KVFLEET_NODE_TIME_SCALE="0.05")
    assert 2.0 <= took < 3.5, said
    assert 0.5 <= engine.scrapes[0] - started < 1.5
    assert "bound of 2s reached" in said
