"""Pod addresses: each running local cluster claims its own loopback range, as a real node's
CNI is given its own pod CIDR. The first cluster on a machine gets 127.0.x.y (pods from
127.0.0.2), a second one running at the same time 127.1.x.y, and so on, so two clusters'
pods never share an address and a port (two `kvfleet cluster up`, or tests in parallel).

A claim is an exclusive lock on a file in the machine's temporary directory, held while the
cluster runs; the operating system releases it when the process ends, however it ends.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path
from typing import IO

RANGES = 200
"""127.0/16 ... 127.199/16: 65,000 pod addresses each."""
LOCK_DIR = Path(tempfile.gettempdir()) / "kvfleet-localcluster-pod-ranges"


class PodRange:
    """A claimed loopback /16 (its second octet); `release()` gives it back."""

    def __init__(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        for octet in range(RANGES):
            handle = open(LOCK_DIR / f"{octet}.lock", "w")  # noqa: SIM115 (held while running)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            handle.write(str(os.getpid()))
            handle.flush()
            self.octet, self._handle = octet, handle
            return
        raise RuntimeError(f"all {RANGES} local pod address ranges are in use")

    def address(self, n: int) -> str:
        """The n-th pod's address (n ≥ 1): 127.<range>.0.2, .3, ... then 127.<range>.1.x."""
        return _address(self.octet, n)

    @staticmethod
    def first(n: int) -> str:
        """The n-th address of the first range (pods that run no process claim nothing)."""
        return _address(0, n)

    def release(self) -> None:
        handle: IO[str] | None = getattr(self, "_handle", None)
        if handle is not None and not handle.closed:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()


def _address(octet: int, n: int) -> str:
    return f"127.{octet}.{n // 254}.{n % 254 + 1}"
