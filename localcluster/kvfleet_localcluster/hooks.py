"""A pod's processes beyond its container's own: preStop hooks, as the kubelet runs them.

A sleep hook (`exec: [sleep, N]`, `sh -c "sleep N"`, the sleep action) is not a process: the
kubelet waits it out on the node's clock (`pre_stop_sleep`). Any other exec hook runs as a
process of the pod (`run_exec_hook`), in real time, until it exits or the grace period ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

Json = dict[str, Any]
TIME_SCALE_ENV = "KVFLEET_NODE_TIME_SCALE"
"""Set for an exec hook: how fast this node's clock runs (the kubelet's `time_scale`). A hook
whose fixed waits derive from the grace period (the engines' drain) scales them as the node
scales that period; its other waits, and any hook that ignores this, are real time."""


def die_with_kubelet() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the pod process gets SIGTERM if the kubelet dies, even by SIGKILL (no leaks)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


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


async def run_exec_hook(
    argv: list[str], env: dict[str, str], log_path: Path, deadline: float
) -> str:
    """Run a hook's command as the container's process is run (its environment, the
    kubelet's working directory, its own session), its output appended to the container's
    log; killed at `deadline` (monotonic), as a kubelet ends a hook at the grace period.
    How it ended, also written to that log."""
    with log_path.open("ab") as out:
        out.write(f"kubelet: preStop hook: running {Path(argv[0]).name}\n".encode())
        out.flush()
        try:
            hook = await asyncio.create_subprocess_exec(
                *argv, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=die_with_kubelet,
            )  # fmt: skip
        except OSError as exc:
            ended = f"cannot start: {exc}"
            out.write(f"kubelet: preStop hook {ended}\n".encode())
            return ended
    try:
        code = await asyncio.wait_for(hook.wait(), max(0.0, deadline - time.monotonic()))
        ended = f"exited with {code}"
    except TimeoutError:
        ended = "killed at the grace period"
    finally:
        if hook.returncode is None:  # the deadline, or the kubelet itself stopping
            with contextlib.suppress(ProcessLookupError):
                os.killpg(hook.pid, signal.SIGKILL)
            await hook.wait()
    with contextlib.suppress(OSError), log_path.open("a") as out:
        out.write(f"kubelet: preStop hook {ended}\n")
    return ended
