"""Start and stop local servers for tests, benchmarks and the demo: free ports, no leaks.

Every process is started in its own session (process group) and stopped with SIGTERM, then
SIGKILL after a grace period, so nothing outlives the `with` block, even when a test fails.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)
"""Linux's default range for ephemeral ports (where the range file cannot be read)."""
FIRST_PORT = 20001
"""The lowest port handed out: clear of the well-known and common service ports under it."""
MIN_PORTS = 1000
"""The fewest ports worth a range below the ephemeral one (else the range above it)."""
FIXED_PORTS = frozenset({30000})
"""Ports the project's manifests give pods (SGLang's default): never handed out."""
_walk = itertools.count()
"""This process's steps through the range: a port handed out is not handed out again soon."""


def port_range() -> range:
    """Ports that `free_port` hands out: `FIRST_PORT` up to the kernel's ephemeral range, or
    above it where it starts too low to leave room below."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        low, high = DEFAULT_EPHEMERAL
    if low > FIRST_PORT + MIN_PORTS:
        return range(FIRST_PORT, low)
    return range(high + 1, 65536)


def free_port() -> int:
    """A port nothing listens on, for a server started a moment later.

    Never one the kernel hands out by itself: a port from its ephemeral range (what `bind` to
    port 0 returns) can be taken by any outgoing connection before the server binds it, and
    tests make many (seen: EADDRINUSE). Each process walks the range from its own offset (by
    pid), so two processes asking at once do not get the same port. A candidate is probed on
    every address, so it is free on whichever one the caller binds: a pod's listener on its
    own loopback IP counts as taken."""
    ports = port_range()
    start = os.getpid() * 7919  # a prime: neighbouring pids start far apart
    for _ in range(len(ports)):
        port = ports[(start + next(_walk)) % len(ports)]
        if port in FIXED_PORTS:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1}")


def wait_http_ok(
    url: str, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Poll until `url` answers 2xx; fail early if the process died. An https URL is probed
    without verifying its certificate, as the kubelet probes HTTPS endpoints."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    context = ssl._create_unverified_context() if url.startswith("https") else None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was ready")
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as resp:
                if 200 <= resp.status < 300:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout}s (last error: {last})")


def wait_tcp(host: str, port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{host}:{port} not accepting connections") from None
            time.sleep(0.05)


def stop_process(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace)


@contextlib.contextmanager
def running_process(
    argv: Sequence[str],
    ready_url: str | None = None,
    log_path: Path | None = None,
    timeout: float = 20.0,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        list(argv),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        if ready_url:
            wait_http_ok(ready_url, timeout, proc)
        yield proc
    finally:
        stop_process(proc)
        if log_path:
            log.close()  # type: ignore[union-attr]


def sim_serve_argv(
    port: int,
    model: str = "llama-3.1-8b",
    gpu: str = "h100",
    host: str = "127.0.0.1",
    extra: Sequence[str] = (),
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvfleet_sim",
        "serve",
        "--model",
        model,
        "--gpu",
        gpu,
        "--host",
        host,
        "--port",
        str(port),
        "--log-level",
        "warning",
        *extra,
    ]


def _worker_args(workers: Sequence[str], prefills: Sequence[tuple[str, int]]) -> list[str]:
    if not prefills:
        return ["--worker-urls", *workers]
    args = ["--pd-disaggregation"]
    for url, port in prefills:
        args += ["--prefill", url, str(port)]
    for url in workers:
        args += ["--decode", url]
    return args


@contextlib.contextmanager
def sglang_router_process(
    workers: Sequence[str],
    log_path: Path | None = None,
    policy: str = "cache_aware",
    timeout: float = 60.0,
    on_started: Callable[[int], None] | None = None,
    prefills: Sequence[tuple[str, int]] = (),
) -> Iterator[str]:
    """The real `sglang-router` in front of `workers`, once it has registered all of them
    (`on_started` is given its process id, for a benchmark that measures its CPU). With
    `prefills` ((URL, bootstrap port) each) it runs in PD mode: `workers` are the decode
    engines.

    Its /health answers 200 before any worker is registered, so readiness is read from
    /workers (start the workers first: three failed health checks drop a worker for good).
    """
    port, metrics_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *_worker_args(workers, prefills),
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
    ]
    url = f"http://127.0.0.1:{port}"
    with running_process(
        argv, ready_url=f"{url}/health", log_path=log_path, timeout=timeout
    ) as proc:
        if on_started is not None:
            on_started(proc.pid)
        deadline = time.monotonic() + timeout
        while True:
            listed = ""
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(f"{url}/workers", timeout=2) as resp,
            ):
                listed = resp.read().decode()
            if all(w in listed for w in [*workers, *(u for u, _ in prefills)]):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"sglang-router did not register {list(workers)}")
            time.sleep(0.2)
        yield url
