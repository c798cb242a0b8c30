"""`GET ...?watch=true`: the API server's watch streams, over the store's event history."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

import aiohttp.web

from kvfleet_localcluster.apitypes import Gone, Kind
from kvfleet_localcluster.store import Store

INITIAL_EVENTS_END = "k8s.io/initial-events-end"


class WatchSource(Protocol):
    @property
    def store(self) -> Store: ...

    @property
    def changed(self) -> asyncio.Event:
        """Set at the next change to the store (a new event each time)."""
        ...

    @property
    def closed(self) -> bool:
        """The server is stopping: watches end."""
        ...


def _bookmark(kind: Kind, rv: int) -> dict[str, Any]:
    return {
        "apiVersion": kind.api_version,
        "kind": kind.kind,
        "metadata": {"resourceVersion": str(rv)},
    }


async def serve_watch(
    source: WatchSource, kind: Kind, ns: str | None, name: str | None, raw: aiohttp.web.BaseRequest
) -> aiohttp.web.StreamResponse:
    """A watch: events from `resourceVersion` (410 when too old), or the current objects then
    an initial-events-end bookmark (`sendInitialEvents`), then changes until timeoutSeconds,
    with periodic bookmarks when asked."""
    q = raw.query
    fields = q.get("fieldSelector")
    if name:  # GET .../pods/x?watch=true: a watch on one object
        fields = ",".join(x for x in (fields, f"metadata.name={name}") if x)
    labels = q.get("labelSelector")
    timeout = float(q.get("timeoutSeconds") or 1800)
    bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
    # Watch-list (kubectl ≥ 1.35 lists this way): the current objects as ADDED events,
    # then a bookmark annotated initial-events-end, then changes.
    initial = q.get("sendInitialEvents") in ("true", "1")
    resp = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
    try:
        since = None if initial else q.get("resourceVersion")
        events, seen = source.store.events_since(kind, ns, since, labels, fields)
    except Gone as gone:
        await resp.prepare(raw)
        await resp.write(json.dumps({"type": "ERROR", "object": gone.status()}).encode() + b"\n")
        return resp
    await resp.prepare(raw)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while True:
            for event, obj in events:
                await resp.write(json.dumps({"type": event, "object": obj}).encode() + b"\n")
                seen = max(seen, int(obj["metadata"]["resourceVersion"]))
            events = []
            if initial:
                initial = False
                mark = _bookmark(kind, seen)
                mark["metadata"]["annotations"] = {INITIAL_EVENTS_END: "true"}
                await resp.write(json.dumps({"type": "BOOKMARK", "object": mark}).encode() + b"\n")
            remaining = deadline - loop.time()
            if remaining <= 0 or source.closed:
                break
            changed = source.changed
            try:  # (not wait_for: it can swallow a cancel that lands as the event is set)
                async with asyncio.timeout(min(remaining, 60)):
                    await changed.wait()
            except TimeoutError:
                if bookmarks:
                    mark = _bookmark(kind, source.store.rv)
                    await resp.write(
                        json.dumps({"type": "BOOKMARK", "object": mark}).encode() + b"\n"
                    )
                continue
            if source.closed:
                break
            events, _ = source.store.events_since(kind, ns, str(seen), labels, fields)
    except (ConnectionResetError, Gone):
        pass
    return resp
