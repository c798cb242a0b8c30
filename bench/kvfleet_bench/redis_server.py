"""A real redis-server for benchmarks and tests: on a free port, killed and started again on
the same port and directory (so an append-only file, when asked for, survives the restart)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import redis

from kvfleet_sim.procs import free_port, stop_process, wait_tcp


@dataclass
class RedisServer:
    binary: str
    workdir: Path
    appendonly: bool = False
    """Persist every write (AOF, fsync always): a restart keeps the data, as the deployment
    docs require. Without it a restart comes back empty."""
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    password: str | None = None
    """`--requirepass`: clients must AUTH (redis.conf's, not the command line's, in
    production; here the process is ours and on loopback)."""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always"]
        argv += ["--dir", str(self.workdir)]
        if self.password is not None:
            argv += ["--requirepass", self.password]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)
        wait_tcp("127.0.0.1", self.port)

    def kill(self) -> None:
        """SIGKILL, as a crash would: no chance to save anything."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password)
