"""`GET .../pods/NAME/log`: a container's output, as the kubelet kept it.

The kubelet writes each run of a container to its own file (`<container>.<run>.log`), so
`--previous` is the run before the current one, as on a node. Parameters as kubectl sends
them: `container` (required when the pod has several), `previous`, `tailLines`,
`limitBytes`, `follow` (the stream stays open until that run of the container ends, the pod
goes away or the server stops).
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


def pick_container(pod: dict[str, Any], asked: str | None) -> str:
    names = [c.get("name", "") for c in (pod.get("spec") or {}).get("containers") or []]
    name = pod["metadata"]["name"]
    if asked is None:
        if len(names) == 1:
            return str(names[0])
        raise ApiError(
            400,
            "BadRequest",
            f"a container name must be specified for pod {name}, choose one of: "
            f"[{' '.join(names)}]",
        )
    if asked not in names:
        raise ApiError(400, "BadRequest", f'container "{asked}" is not valid for pod "{name}"')
    return asked


async def serve_logs(
    raw: aiohttp.web.BaseRequest,
    pod: dict[str, Any],
    source: LogSource,
    closed: Callable[[], bool],
    container_name: str | None = None,
) -> aiohttp.web.StreamResponse:
    """The log of `container_name` (the kubelet API names it in the path), else of the
    `container` query parameter (the API server's pods/log)."""
    q = raw.query
    ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    container = pick_container(pod, container_name or q.get("container"))
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
