"""The kubelet API's `containerLogs`: a container's output, as the node agent kept it, for
the API server's `pods/NAME/log` (`kubectl logs`).

The kubelet writes each run of a container to its own file (`<container>.<run>.log`), so
`--previous` is the run before the current one, as on a node. Parameters as the API server
passes them on from kubectl: `previous`, `tailLines`, `limitBytes`, `follow` (the stream
stays open until that run of the container ends, the pod goes away or the server stops).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import aiohttp.web

from kvfleet_localcluster.apitypes import ApiError

FOLLOW_POLL_S = 0.2


class LogSource(Protocol):
    def runs(self, namespace: str, pod: str, container: str) -> list[Path]:
        """The container's log files, one per run, oldest first."""
        ...

    def running(self, namespace: str, pod: str, container: str, run: Path) -> bool:
        """Whether `run` is the live run of a container still on this node."""
        ...


def _int(query: Any, name: str) -> int | None:
    value = query.get(name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise ApiError(400, "BadRequest", f"{name} must be an integer, not {value!r}") from None
    if number < 0:
        raise ApiError(400, "BadRequest", f"{name} must be >= 0")
    return number


def _tail(data: bytes, lines: int | None) -> bytes:
    if lines is None:
        return data
    if lines == 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


def _check_container(pod: dict[str, Any], container: str) -> None:
    names = [c.get("name", "") for c in (pod.get("spec") or {}).get("containers") or []]
    if container not in names:
        name = pod["metadata"]["name"]
        raise ApiError(400, "BadRequest", f'container "{container}" is not valid for pod "{name}"')


async def serve_logs(
    raw: aiohttp.web.BaseRequest,
    pod: dict[str, Any],
    container: str,
    source: LogSource,
    closed: Callable[[], bool],
) -> aiohttp.web.StreamResponse:
    """The log of `container` (the kubelet API names it in the path; the API server has
    chosen it for a pod of one container)."""
    q = raw.query
    ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    _check_container(pod, container)
    previous = q.get("previous") in ("true", "1")
    follow = q.get("follow") in ("true", "1") and not previous
    tail, limit = _int(q, "tailLines"), _int(q, "limitBytes")
    runs = source.runs(ns, name, container)
    if previous:
        # The run before the live one; while the container waits to restart (CrashLoopBackOff)
        # the last run is the previous one — what `--previous` is for.
        live = bool(runs) and source.running(ns, name, container, runs[-1])
        ended = runs[:-1] if live else runs
        if not ended:
            raise ApiError(
                400,
                "BadRequest",
                f'previous terminated container "{container}" in pod "{name}" not found',
            )
        run: Path | None = ended[-1]
    else:
        run = runs[-1] if runs else None
    data = _tail(run.read_bytes(), tail) if run is not None else b""
    if limit is not None:
        data = data[:limit]
    resp = aiohttp.web.StreamResponse(headers={"Content-Type": "text/plain"})
    await resp.prepare(raw)
    await resp.write(data)
    if not follow or run is None:
        return resp
    offset = run.stat().st_size
    sent = len(data)
    while not closed() and (limit is None or sent < limit):
        size = run.stat().st_size if run.exists() else offset
        if size > offset:
            with run.open("rb") as f:
                f.seek(offset)
                chunk = f.read(size - offset)
            offset = size
            if limit is not None:
                chunk = chunk[: limit - sent]
            sent += len(chunk)
            try:
                await resp.write(chunk)
            except ConnectionResetError:
                break
        elif not source.running(ns, name, container, run):
            break
        else:
            await asyncio.sleep(FOLLOW_POLL_S)
    return resp
