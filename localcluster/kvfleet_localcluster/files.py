"""Files the local cluster writes for others to read while it runs (the kubeconfig, the
node's Service table, Prometheus's scrape targets): replaced whole, never seen half-written."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def replace_file(path: Path, text: str, mode: int = 0o644) -> None:
    """`text` into `path` at once: written to a temporary file beside it, then renamed over
    it, so a reader (a script waiting for it, `kubectl`, Prometheus, a pod) sees the old file
    or the new one. `mode` 0o600 for a file holding a secret (it is never readable wider)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "w") as out:
            os.fchmod(out.fileno(), mode)
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
