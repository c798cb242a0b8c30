"""The kernel's inotify instance limit, which a local cluster's components share with every
other process of the same user.

kube-apiserver and kube-controller-manager watch each certificate file they are given (six
inotify instances each, measured), the scheduler and the LeaderWorkerSet controller one
each. Linux allows a user 128 instances by default (`fs.inotify.max_user_instances`), so
about nine local clusters at once exhaust it, and the component that asks next exits with
"too many open files". kind's known-issues page gives the same advice this module prints.
"""

from __future__ import annotations

import os
from pathlib import Path

LIMIT_FILE = Path("/proc/sys/fs/inotify/max_user_instances")
PER_CLUSTER = 14
"""Instances one local cluster holds: kube-apiserver 6, kube-controller-manager 6,
kube-scheduler 1, lws-controller 1 (counted from /proc/<pid>/fd on Kubernetes v1.37)."""
RECOMMENDED = 512
EXHAUSTED_MARK = "too many open files"


def limit() -> int | None:
    """`fs.inotify.max_user_instances`; None where there is no such file (not Linux)."""
    try:
        return int(LIMIT_FILE.read_text())
    except (OSError, ValueError):
        return None


def in_use(proc: Path = Path("/proc")) -> int:
    """The inotify instances this user's processes hold (those whose fds it can read)."""
    count = 0
    for pid in proc.iterdir():
        if not pid.name.isdigit():
            continue
        try:
            fds = list((pid / "fd").iterdir())
        except OSError:  # another user's process, or one that just exited
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == "anon_inode:inotify":
                    count += 1
            except OSError:
                continue
    return count


def advice(limit_now: int | None, used: int | None = None) -> str:
    held = f"; {used} in use" if used is not None else ""
    return (
        f"the kernel's inotify instance limit (fs.inotify.max_user_instances = {limit_now}"
        f"{held}) is likely used up: each local cluster holds about {PER_CLUSTER}. Stop "
        f"clusters you no longer need, or raise it: "
        f"sudo sysctl fs.inotify.max_user_instances={RECOMMENDED}"
    )


def shortfall() -> str | None:
    """Why one more cluster would not start (the advice), or None while there is room."""
    limit_now = limit()
    if limit_now is None:
        return None
    used = in_use()
    return advice(limit_now, used) if limit_now - used < PER_CLUSTER else None


def explain_exit(log_tail: str) -> str:
    """A hint to append to a component's exit report when its log says the limit was hit."""
    return f"\nProbably {advice(limit())}" if EXHAUSTED_MARK in log_tail.lower() else ""
