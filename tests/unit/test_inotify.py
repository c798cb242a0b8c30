"""The inotify instance limit a local cluster shares with the rest of the machine: counted
from the kernel's own view (/proc), refused before a start with the remedy, and named when a
component dies of it."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import pytest

from kvfleet_localcluster import inotify

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


@linux_only
def test_a_new_inotify_instance_is_counted_and_its_close_uncounted() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    before = inotify.in_use()
    fd = libc.inotify_init1(os.O_CLOEXEC)
    assert fd >= 0, ctypes.get_errno()
    try:
        # Other processes on the machine may open or close theirs meanwhile: ours is one
        # of those now counted, and the count is bounded by the kernel's limit.
        assert inotify.in_use() >= 1
        assert os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
    finally:
        os.close(fd)
    assert inotify.in_use() <= before + 1


def test_only_inotify_descriptors_of_readable_processes_count(tmp_path: Path) -> None:
    for pid, targets in {"101": ["anon_inode:inotify", "anon_inode:inotify", "/dev/null"],
                         "202": ["socket:[77]", "anon_inode:inotify"]}.items():  # fmt: skip
        fd_dir = tmp_path / pid / "fd"
        fd_dir.mkdir(parents=True)
        for n, target in enumerate(targets):
            (fd_dir / str(n)).symlink_to(target)
    (tmp_path / "303").mkdir()  # no fd directory: a process that exited, or not ours
    (tmp_path / "self").mkdir()  # not a pid
    assert inotify.in_use(tmp_path) == 3


def test_a_start_is_refused_with_the_remedy_when_no_room_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(inotify, "limit", lambda: 128)
    monkeypatch.setattr(inotify, "in_use", lambda: 128 - inotify.PER_CLUSTER + 1)
    short = inotify.shortfall()
    assert short is not None
    assert "fs.inotify.max_user_instances = 128; 115 in use" in short
    assert "sudo sysctl fs.inotify.max_user_instances=512" in short
    monkeypatch.setattr(inotify, "in_use", lambda: 128 - inotify.PER_CLUSTER)
    assert inotify.shortfall() is None
    monkeypatch.setattr(inotify, "limit", lambda: None)  # not Linux: nothing to check
    assert inotify.shortfall() is None


def test_a_component_that_died_of_the_limit_is_told_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inotify, "limit", lambda: 128)
    tail = 'ERROR\tsetup\tproblem running manager\t{"error": "too many open files"}'
    assert "fs.inotify.max_user_instances = 128" in inotify.explain_exit(tail)
    assert inotify.explain_exit("ERROR\tsetup\tbind: address already in use") == ""
