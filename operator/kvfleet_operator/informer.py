"""List-then-watch one kind of child with a server-side label selector, as client-go's
informers do, feeding the watch cache and waking the owner's reconcile.

The operator's children carry its labels, so the API server filters: a cluster's other pods,
ConfigMaps and Services never reach the operator (kopf's `labels=` filters client-side, after
the whole stream arrived). Each informer

* LISTs with the selector, replaces the cache's contents for its kind and scope (objects that
  vanished meanwhile go, and their owners are reconciled), then watches from the list's
  resourceVersion with bookmarks;
* resumes a watch that ended from the last resourceVersion seen (an event's or a bookmark's);
* relists on 410 Gone (the server no longer holds history that old) and after an error,
  with backoff — resourceVersions are passed back to the server, never compared.

An object whose labels are removed leaves the selector: the watch reports it DELETED (with
the labels it had, so its owner is reconciled), and that reconcile finds it missing from
the cache, reads it from the API server and applies the labels back. Runs in its own
thread (the `kubernetes` client is synchronous).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from kvfleet_kernel.schema import Json
from kvfleet_operator.cache import WatchCache
from kvfleet_operator.kube import Kube, Resource

log = logging.getLogger("kvfleet.operator")


class Gone(Exception):
    """The watch's resourceVersion is too old: relist."""


def _lines(response: Any) -> Iterator[bytes]:
    """Newline-delimited JSON as it arrives (not buffered to the end of the stream)."""
    pending = b""
    for chunk in response.stream(amt=None, decode_content=True):
        pending += chunk
        *done, pending = pending.split(b"\n")
        yield from (line for line in done if line.strip())
    if pending.strip():
        yield pending


@dataclass
class Informer:
    kube: Kube
    resource: Resource
    namespace: str | None
    """None: the whole cluster."""
    selector: str
    cache: WatchCache
    on_change: Callable[[Json], None]
    """Called (on this thread) with every object that changed, appeared or vanished."""
    watch_s: int = 300
    """Each watch request asks the server to end after this long (then it resumes)."""
    max_backoff_s: float = 30.0
    events: int = 0
    """Objects delivered (listed or watched): what this operator was sent."""
    _response: Any = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def relist(self) -> str:
        """LIST, replace the cache's contents; the list's resourceVersion."""
        path = self.resource.path(self.namespace)
        listed = self.kube.request("GET", path, query={"labelSelector": self.selector})
        items: list[Json] = listed.get("items") or []
        self.events += len(items)
        for gone in self.cache.replace(self.resource.plural, self.namespace, items):
            self.on_change(gone)
        return str((listed.get("metadata") or {}).get("resourceVersion") or "")

    def watch(self, rv: str) -> str:
        """One watch request from `rv`; the last resourceVersion seen when it ends."""
        query = {
            "watch": "true",
            "labelSelector": self.selector,
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.watch_s),
        }
        # The read bound: the server's own end of the watch plus a margin (bookmarks and
        # events arrive well within it on a healthy server).
        self._response = self.kube.open_stream(
            self.resource.path(self.namespace), query, self.watch_s + self.kube.timeout_s
        )
        try:
            for line in _lines(self._response):
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone(obj.get("message", ""))
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if kind == "BOOKMARK":
                    continue
                self.events += 1
                self.cache.observe(self.resource.plural, kind, obj)
                self.on_change(obj)
        finally:
            self._response.release_conn()
        return rv

    def run(self, first_rv: str) -> None:
        """Watch until `stop()`, from the resourceVersion of the LIST made at startup."""
        rv, failures = first_rv, 0
        while not self._stop.is_set():
            try:
                if not rv:
                    rv = self.relist()
                rv = self.watch(rv)
                failures = 0
            except Gone:
                rv = ""
            except Exception as exc:
                if self._stop.is_set():
                    return
                failures += 1
                delay = min(self.max_backoff_s, 0.5 * 2**failures)
                log.warning("watch of %s failed (%s); relist in %.1fs", self.what, exc, delay)
                rv = ""
                self._stop.wait(delay)

    @property
    def what(self) -> str:
        return f"{self.resource.plural} in {self.namespace or 'all namespaces'}"

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            try:
                response.shutdown()  # unblocks the read on the watch thread
            except Exception as exc:  # already closed: nothing to unblock
                log.debug("closing the watch of %s: %s", self.what, exc)
