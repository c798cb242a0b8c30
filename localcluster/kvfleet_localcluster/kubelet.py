"""The local cluster's kubelet: each pod a local process on its own loopback IP.

What a node would do, without containers: a pod of a known image runs as a subprocess
(`containers.py`) — `python3 -m sglang.launch_server FLAGS` as `python -m kvfleet_sim serve`
with the same flags (those the simulator does not model are dropped and listed in the pod's
log), `kvfleet ...` (the kvfleet image) as itself. Each pod gets its own address (127.0.0.2,
.3, ... — all of 127/8 is loopback on Linux), and the process binds it, so every pod listens
on the port its manifest names. Startup, readiness and liveness probes are executed against
the process and set the pod's conditions; a process that exits is restarted with the
kubelet's doubling backoff; a deleted pod runs its preStop sleep (serving meanwhile), then
gets SIGTERM, then SIGKILL after its grace period.

No mount or network namespaces exist here, so both are emulated. Volumes: ConfigMaps and
Secrets are written to a per-pod directory; each mountPath is substituted by that directory
in the command line, environment and mounted text files; the service-account volume, whose
path client libraries hard-code, is redirected inside the process (`podshim/sitecustomize.py`,
loaded through PYTHONPATH). The network: that shim binds a wildcard listener (0.0.0.0, ::) to
the pod's address.

Pods log in to the API server as on a real node: the service-account volume at
/var/run/secrets/kubernetes.io/serviceaccount (a token issued for the pod's ServiceAccount,
the cluster CA, the namespace) and KUBERNETES_SERVICE_HOST/PORT. A container whose env or
volumes reference a Secret, ConfigMap, key or PVC that does not exist does not start
(`CreateContainerConfigError`, `ContainerCreating`) until it appears. The downward API
(`fieldRef`: metadata.name, metadata.namespace, status.podIP, ...) fills env values.
Containers of other images run no process and become Ready after a delay (as in the
no-process mode used by fast tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from kvfleet_localcluster.containers import container_argv, gpu_of, termination_message
from kvfleet_localcluster.podspec import (
    ClusterAccess,
    ConfigMissing,
    PodSandbox,
    substitute,
)

__all__ = ["ClusterAccess", "ConfigMissing", "KubeletConfig", "PodRunner", "substitute"]
log = logging.getLogger("kvfleet.cluster.kubelet")
CREATING = ("ContainerCreating", "CreateContainerConfigError")
"""Waiting reasons of a container that has not started yet (the pod is Pending)."""

Json = dict[str, Any]


def _die_with_kubelet() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the pod process gets SIGTERM if the kubelet dies, even by SIGKILL (no leaks)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class KubeletConfig:
    run_processes: bool = True
    """False: no process runs; every pod becomes Ready after `ready_delay_s` (fast tests)."""
    ready_delay_s: float = 0.2
    """No-process pods (and containers of unknown images): time to Ready."""
    state_dir: Path | None = None
    """Where pods' volumes and logs live (`<state_dir>/pods/<ns>_<pod>/`); None: a temporary
    directory of the local cluster, removed when it stops."""
    time_scale: float = 0.1
    """Multiplier on probe periods, restart backoff and grace periods: 0.1 makes a local
    pod start, restart and stop ten times faster than on a real node; 1.0 = kubelet timing."""
    engine_time_scale: float = 1.0
    """`--time-scale` of simulated engines (wall seconds per simulated GPU second)."""
    engine_startup_delay_s: float = 0.5
    """Simulated model load: engines answer /health 503 this long."""
    engine_command: tuple[str, ...] = (sys.executable, "-m", "kvfleet_sim")
    """What runs an SGLang engine container: the simulator's own entry point, given
    `serve` and the mapped flags."""
    kvfleet_command: tuple[str, ...] = (sys.executable, "-m", "kvfleet_cli")
    """What runs a kvfleet-image container (the image's `kvfleet` entry point): by default
    this Python's; a runtime-only install's `kvfleet` to test what the image ships."""
    redis_server: str | None = field(default_factory=lambda: shutil.which("redis-server"))
    """What runs a `redis` image container (its entry point is redis-server): this
    machine's redis-server; None (not installed): such pods run no process."""

    def __post_init__(self) -> None:
        # Pods run in their own working directories and Prometheus resolves file_sd paths
        # against its config file's folder: a relative path must never leave this process.
        if self.state_dir is not None:
            object.__setattr__(self, "state_dir", self.state_dir.resolve())


def node_dir(config: KubeletConfig) -> Path:
    """This node's state: pods' directories, persistent volumes, the Service table."""
    return config.state_dir or Path(tempfile.gettempdir()) / "kvfleet-cluster"


def pod_dir(config: KubeletConfig, ns: str, name: str) -> Path:
    """Where a pod's volumes and logs live on this node."""
    return node_dir(config) / "pods" / f"{ns}_{name}"


def service_table_file(config: KubeletConfig) -> Path:
    """The Service table pods resolve names from (`services.py`)."""
    return node_dir(config) / "services.json"


def log_file(directory: Path, container: str, run: int) -> Path:
    """One file per run of a container, so `--previous` is the run before."""
    return directory / f"{container}.{run}.log"


def log_runs(directory: Path, container: str) -> list[Path]:
    """A container's log files, oldest run first."""
    runs = []
    for f in directory.glob(f"{container}.*.log"):
        number = f.name[len(container) + 1 : -len(".log")]
        if number.isdigit():
            runs.append((int(number), f))
    return [f for _, f in sorted(runs)]


@dataclass
class PodRunner:
    """One pod's life on this node: volumes, its process, probes, restarts, stop."""

    ns: str
    name: str
    pod_ip: str
    spec: Json
    config: KubeletConfig
    status_writer: Any
    """Callable(status_patch: Json) writing the pod's status through the API."""
    secrets: Any
    """Callable(ns, kind, name) -> object | None, reading ConfigMaps, Secrets and PVCs."""
    access: ClusterAccess | None = None
    """The API server, for the pod's service-account volume; None: pods get no credentials."""
    meta: Json = field(default_factory=dict)
    """The pod's metadata (name, namespace, uid, labels) for the downward API."""
    record_event: Any = None
    """Callable(reason, message) posting a Warning Event about this pod, as the kubelet's
    event recorder does (repeats are counted on one Event); None: no Events."""
    restarts: int = 0
    last_state: Json = field(default_factory=dict)
    """The container's previous run as it ended (`lastState`): empty until one has."""
    ready: bool = False
    proc: asyncio.subprocess.Process | None = None
    _started: str = field(default_factory=now)

    @property
    def pod_dir(self) -> Path:
        return pod_dir(self.config, self.ns, self.name)

    def _scaled(self, seconds: float) -> float:
        return max(0.05, seconds * self.config.time_scale)

    @property
    def sandbox(self) -> PodSandbox:
        return PodSandbox(
            self.ns, self.name, self.pod_ip, self.spec, self.meta, self.pod_dir, self.secrets,
            self.access, node_dir(self.config) / "volumes", service_table_file(self.config),
        )  # fmt: skip

    # ---- status ---------------------------------------------------------------------------
    def _write(self, container: Json, state: Json, ready: bool, started: bool) -> None:
        self.ready = ready
        cond = "True" if ready else "False"
        waiting = (state.get("waiting") or {}).get("reason")
        self.status_writer(
            {
                "phase": "Pending" if waiting in CREATING else "Running",
                "podIP": self.pod_ip,
                "podIPs": [{"ip": self.pod_ip}],
                "hostIP": "127.0.0.1",
                "startTime": self._started,
                "conditions": [
                    {"type": "PodScheduled", "status": "True"},
                    {"type": "Initialized", "status": "True"},
                    {"type": "ContainersReady", "status": cond, "lastTransitionTime": now()},
                    {"type": "Ready", "status": cond, "lastTransitionTime": now()},
                ],
                "containerStatuses": [
                    {
                        "name": container.get("name"),
                        "image": container.get("image", ""),
                        "imageID": "",
                        "ready": ready,
                        "started": started,
                        "restartCount": self.restarts,
                        "state": state,
                        "lastState": self.last_state,
                    }
                ],
            }
        )

    # ---- probes ---------------------------------------------------------------------------
    @staticmethod
    def _port(port: Any, container: Json) -> Any:
        if isinstance(port, str) and not port.isdigit():
            return next(
                (p["containerPort"] for p in container.get("ports") or [] if p.get("name") == port),
                None,
            )
        return port

    async def _probe(self, s: aiohttp.ClientSession, probe: Json, container: Json) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        if tcp := probe.get("tcpSocket"):
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.pod_ip, self._port(tcp.get("port"), container)),
                    timeout,
                )
            except (TimeoutError, OSError):
                return False
            writer.close()
            return True
        http = probe.get("httpGet")
        if not http:
            return True  # exec probes: the process being up is the signal here
        port = self._port(http.get("port"), container)
        url = f"http://{self.pod_ip}:{port}{http.get('path', '/')}"
        try:
            async with s.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return 200 <= r.status < 400
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    # ---- life -----------------------------------------------------------------------------
    async def _wait_for_references(self, container: Json) -> None:
        """Hold the container in ContainerCreating / CreateContainerConfigError until every
        Secret, ConfigMap, key and PVC it needs exists, re-checking as the kubelet does."""
        reported = None
        while True:
            try:
                self.sandbox.check_references(container)
                return
            except ConfigMissing as missing:
                # As a real kubelet: a volume that cannot mount leaves the container in
                # ContainerCreating with no message (the reason is only in the FailedMount
                # Event); a missing env source is CreateContainerConfigError with its message.
                mount = missing.reason == "ContainerCreating"
                if reported != missing.message:
                    reported = missing.message
                    log.info("pod %s/%s: %s", self.ns, self.name, missing.message)
                    state = {"reason": missing.reason}
                    if not mount:
                        state["message"] = missing.message
                    self._write(container, {"waiting": state}, False, False)
                if self.record_event is not None:
                    reason = "FailedMount" if mount else "Failed"
                    self.record_event(
                        reason, missing.message if mount else f"Error: {missing.message}"
                    )
            await asyncio.sleep(self._scaled(10.0))

    async def run(self) -> None:
        container = (self.spec.get("containers") or [{}])[0]
        gpu = gpu_of(self.spec)
        await self._wait_for_references(container)
        if (
            container_argv(container, self.pod_ip, gpu, self.config) is None
            or not self.config.run_processes
        ):
            await asyncio.sleep(self.config.ready_delay_s)
            self._write(container, {"running": {"startedAt": now()}}, True, True)
            await asyncio.Event().wait()  # a pause container: nothing to do until deleted
            return
        self.pod_dir.mkdir(parents=True, exist_ok=True)
        backoff = 10.0
        async with aiohttp.ClientSession() as session:
            while True:
                await self._wait_for_references(container)
                mounts = self.sandbox.materialize(container)
                expanded = self.sandbox.expand(container, mounts)
                argv, notes = container_argv(expanded, self.pod_ip, gpu, self.config, mounts) or (
                    [],
                    [],
                )
                started = now()
                exit_code = await self._run_once(session, container, argv, notes, mounts)
                reason = "Completed" if exit_code == 0 else "Error"
                run_log = log_file(self.pod_dir, container.get("name", "main"), self.restarts)
                ended = {"exitCode": exit_code, "reason": reason, "startedAt": started,
                         "finishedAt": now()}  # fmt: skip
                if message := termination_message(container, run_log, exit_code):
                    ended["message"] = message
                self.last_state = {"terminated": ended}
                self.restarts += 1
                waiting = {
                    "waiting": {
                        "reason": "CrashLoopBackOff",
                        "message": f"exited with {exit_code} ({reason}); back-off {backoff:.0f}s",
                    }
                }
                self._write(container, waiting, False, False)
                log.info(
                    "pod %s/%s exited with %s; restart in %.1fs",
                    self.ns,
                    self.name,
                    exit_code,
                    self._scaled(backoff),
                )
                await asyncio.sleep(self._scaled(backoff))
                backoff = min(300.0, backoff * 2)

    async def _run_once(
        self,
        session: aiohttp.ClientSession,
        container: Json,
        argv: list[str],
        notes: list[str],
        mounts: dict[str, Path],
    ) -> int:
        logfile = log_file(self.pod_dir, container.get("name", "main"), self.restarts)
        with logfile.open("ab") as out:
            for note in notes:
                out.write(note.encode() + b"\n")
            out.flush()
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    env=self.sandbox.env(container, mounts),
                    start_new_session=True,
                    preexec_fn=_die_with_kubelet,
                )
            except OSError as exc:  # the image's command cannot run: RunContainerError
                out.write(f"kubelet: cannot start {argv[:1]}: {exc}\n".encode())
                log.warning("pod %s/%s cannot start: %s", self.ns, self.name, exc)
                return 128
        self._write(container, {"running": {"startedAt": now()}}, False, False)
        prober = asyncio.create_task(self._probe_loop(session, container))
        syncer = asyncio.create_task(self._sync_secrets(container))
        try:
            return await self.proc.wait()
        finally:
            for task in (prober, syncer):  # both at once: a cancel landing mid-wait skips none
                task.cancel()
            for task in (prober, syncer):
                await cancel_and_wait(task)

    async def _sync_secrets(self, container: Json) -> None:
        """Mounted Secrets follow their Secret, as the kubelet's sync loop (about a minute on
        a node; scaled here) keeps them: a rotated API key reaches the gateway's file."""
        while True:
            await asyncio.sleep(self._scaled(10.0))
            if self.sandbox.refresh_secrets(container):
                log.info("pod %s/%s: mounted secrets updated", self.ns, self.name)

    async def _probe_loop(self, session: aiohttp.ClientSession, container: Json) -> None:
        startup, readiness, liveness = (
            container.get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe")
        )
        first = max(
            float((p or {}).get("initialDelaySeconds", 0)) for p in (startup, readiness, liveness)
        )
        if first:
            await asyncio.sleep(self._scaled(first))
        if startup:
            failures, threshold = 0, int(startup.get("failureThreshold", 3))
            deadline = time.monotonic() + _real_window(startup, threshold)
            while not await self._probe(session, startup, container):
                failures += 1
                if failures >= threshold and time.monotonic() >= deadline:
                    log.warning(
                        "pod %s/%s failed its startup probe: restarting", self.ns, self.name
                    )
                    self._signal(signal.SIGKILL)
                    return
                await asyncio.sleep(self._scaled(float(startup.get("periodSeconds", 10))))
        running = {"running": {"startedAt": self._started}}
        ready_fail = live_fail = 0
        last_alive = time.monotonic()
        while True:
            if readiness:
                ok = await self._probe(session, readiness, container)
                ready_fail = 0 if ok else ready_fail + 1
                now_ready = ok or (
                    self.ready and ready_fail < int(readiness.get("failureThreshold", 3))
                )
            else:
                now_ready = True
            if now_ready != self.ready:
                self._write(container, running, now_ready, True)
            if liveness:
                if await self._probe(session, liveness, container):
                    live_fail, last_alive = 0, time.monotonic()
                else:
                    live_fail += 1
                threshold = int(liveness.get("failureThreshold", 3))
                if live_fail >= threshold and (
                    time.monotonic() - last_alive >= _real_window(liveness, threshold - 1)
                ):
                    log.warning(
                        "pod %s/%s failed its liveness probe: restarting", self.ns, self.name
                    )
                    self._signal(signal.SIGKILL)
                    return
            period = (readiness or liveness or {}).get("periodSeconds", 10)
            await asyncio.sleep(self._scaled(float(period)))

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    async def stop(self, pre_stop: bool = True) -> None:
        """Graceful, as a kubelet stops a container: its preStop hook, then SIGTERM, then
        SIGKILL once terminationGracePeriodSeconds (which the hook counts against) are over —
        with the one-off 2 s extension a kubelet grants a hook that ran past them.
        `pre_stop=False` (the node going away): SIGTERM at once, within the same grace."""
        if self.proc is None or self.proc.returncode is not None:
            return
        grace = self._scaled(float(self.spec.get("terminationGracePeriodSeconds", 30)))
        deadline = time.monotonic() + grace
        if pre_stop:
            await self._pre_stop((self.spec.get("containers") or [{}])[0], deadline)
        self._signal(signal.SIGTERM)
        try:
            left = max(deadline - time.monotonic(), self._scaled(2.0))
            await asyncio.wait_for(self.proc.wait(), timeout=left)
        except TimeoutError:
            self._signal(signal.SIGKILL)
            await self.proc.wait()

    async def _pre_stop(self, container: Json, deadline: float) -> None:
        """The container's preStop hook, before SIGTERM and within the grace period. A sleep
        (`exec: [sleep, N]`, or the sleep action) passes on the node's clock (scaled, as the
        grace period is): the process keeps serving while its endpoints are withdrawn, the
        reason engines carry one. Other hooks are not run (no container to run them in); the
        pod's log says so."""
        hook = (container.get("lifecycle") or {}).get("preStop")
        if not hook:
            return
        seconds = pre_stop_sleep(hook)
        if seconds is None:
            log_path = log_file(self.pod_dir, container.get("name", "main"), self.restarts)
            with contextlib.suppress(OSError), log_path.open("a") as out:
                out.write(f"kubelet: preStop hook {hook} not run: only a sleep is emulated\n")
            return
        await asyncio.sleep(max(0.0, min(self._scaled(seconds), deadline - time.monotonic())))

    def cleanup(self) -> None:
        shutil.rmtree(self.pod_dir / "volumes", ignore_errors=True)


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and wait until it has ended, cancelling again while it runs on. A cancel
    can be swallowed: one that lands as a timeout fires is turned into a TimeoutError (aiohttp's
    timer, Python 3.11's wait_for), which a probe counts as a failed probe and goes on. A
    single cancel then waited for forever (seen: the cluster's shutdown hung 120 s)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    with contextlib.suppress(asyncio.CancelledError):
        await task  # its own exception, if it ended on one


def pre_stop_sleep(hook: Json) -> float | None:
    """The seconds a preStop hook sleeps: the sleep action, `exec: [sleep, N]` or
    `exec: [sh, -c, "sleep N"]`; None for any other hook."""
    if isinstance(hook.get("sleep"), dict):
        return float(hook["sleep"].get("seconds", 0))
    command = [str(c) for c in ((hook.get("exec") or {}).get("command") or [])]
    if len(command) == 3 and os.path.basename(command[0]) in ("sh", "bash") and command[1] == "-c":
        command = command[2].split()
    if len(command) == 2 and os.path.basename(command[0]) == "sleep":
        with contextlib.suppress(ValueError):
            return float(command[1])
    return None


def _real_window(probe: Json, periods: int) -> float:
    """How long a probe must keep failing, in real seconds, before the kubelet restarts the
    container: `periods` × `periodSeconds`, unscaled (a startup probe: failureThreshold periods
    from the start; liveness: failureThreshold − 1 periods since its last success, the span of
    that many consecutive failures). The time scale shortens the waits
    between probes, not a process's own start or a busy moment: a gateway importing its
    libraries on a loaded machine takes the seconds it takes, and a real kubelet gives it
    `failureThreshold` × `periodSeconds` (a stand-in stricter than that restarts healthy pods
    in a loop)."""
    return float(periods) * float(probe.get("periodSeconds", 10))
