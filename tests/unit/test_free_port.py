"""`free_port`: ports no outgoing connection can take before the server binds them."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvfleet_sim import procs


def ephemeral() -> range:
    low, high = (int(x) for x in procs.EPHEMERAL_RANGE_FILE.read_text().split())
    return range(low, high + 1)


@pytest.mark.skipif(not procs.EPHEMERAL_RANGE_FILE.exists(), reason="Linux only")
def test_ports_come_from_outside_the_kernels_ephemeral_range() -> None:
    ports = [procs.free_port() for _ in range(200)]
    assert not set(ports) & set(ephemeral())
    with socket.create_server(("127.0.0.1", 0)) as server:  # what port 0 and connections get
        assert server.getsockname()[1] in ephemeral()
    assert len(set(ports)) == 200  # a port handed out is not handed out again soon


def test_the_range_sits_below_the_ephemeral_range_or_above_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranges = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(procs, "EPHEMERAL_RANGE_FILE", ranges)
    ranges.write_text("32768\t60999\n")
    assert procs.port_range() == range(20001, 32768)
    ranges.write_text("1024\t60000\n")  # no room below: above it
    assert procs.port_range() == range(60001, 65536)
    ranges.unlink()  # unreadable: Linux's default
    assert procs.port_range() == range(20001, 32768)


def test_a_port_listened_on_at_any_address_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        with socket.socket() as probe:
            try:
                probe.bind(("", port + 1))
            except OSError:
                continue
        break
    with socket.create_server(("127.0.0.3", port)):  # a pod's address, not the caller's
        monkeypatch.setattr(procs, "port_range", lambda: range(port, port + 2))
        assert {procs.free_port() for _ in range(4)} == {port + 1}
        monkeypatch.setattr(procs, "port_range", lambda: range(port, port + 1))
        with pytest.raises(RuntimeError, match="no free port"):
            procs.free_port()
