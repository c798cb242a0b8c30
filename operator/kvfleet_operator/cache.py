"""What the operator's watches already told it, so a steady-state reconcile asks nothing.

A reconcile reads its InferenceService, each child it renders and the engine pods. Read from
the API server, that is a dozen GETs per service per resync — 200 requests/s for 1,000
services at a 60 s resync. The operator watches every one of those kinds anyway (to react
to drift), so the watches feed this cache and reads are answered from it; the API server
only sees the watches and the writes.

* A LIST (`replace`) sets a kind's contents — in one namespace or the whole cluster — and
  removes what vanished since (a relist after 410 Gone must not keep deleted objects).
* Watch events (`observe`) arrive in order, so the latest one is the truth. resourceVersions
  are opaque: they are compared for equality only, never ordered.
* The operator's own write responses (`wrote`) are newer than anything its watch delivered
  before them, so they are held over the watched copy until the watch delivers that very
  resourceVersion (or the object's deletion, or a relist): a reconcile right after a write
  reads what it wrote, and a late event never rolls the object back.
* A kind that is not primed (not watched here) is read from the API server.

Thread-safe: events arrive on the watch threads and kopf's loop, reads come from the
reconcile worker thread.
"""

from __future__ import annotations

import collections
import copy
import threading
from collections.abc import Iterable, Mapping
from typing import Any

Json = dict[str, Any]
Key = tuple[str, str]


def _key(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


def _rv(obj: Mapping[str, Any] | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("resourceVersion")


def _selector(selector: str | None) -> dict[str, str]:
    """The equality terms the operator's selectors use (`a=b,c=d`)."""
    out: dict[str, str] = {}
    for term in (selector or "").split(","):
        if "=" in term:
            k, _, v = term.partition("=")
            out[k.strip()] = v.strip().lstrip("=")
    return out


class WatchCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[str, dict[Key, Json]] = {}
        self._written: dict[str, dict[Key, Json]] = {}
        """Write responses the watch has not delivered yet (they win over `_watched`)."""
        self._seen: dict[tuple[str, Key], collections.deque[str | None]] = {}
        """The latest resourceVersions the watch delivered per object: a write response
        that arrives after its own event (and a later one) must not be held."""
        self._primed: set[str] = set()
        self.hits = 0
        """Reads answered here instead of by the API server."""

    def primed(self, plural: str) -> bool:
        with self._lock:
            return plural in self._primed

    def replace(self, plural: str, namespace: str | None, items: Iterable[Json]) -> list[Json]:
        """The result of a LIST of `plural` (in `namespace`; None: the cluster): from now on
        `plural` is answered from the cache. Returns the objects that vanished."""
        fresh = {_key(obj): copy.deepcopy(obj) for obj in items}
        with self._lock:
            bucket = self._watched.setdefault(plural, {})
            written = self._written.setdefault(plural, {})
            gone = [k for k in bucket if namespace in (None, k[0]) and k not in fresh]
            vanished = [bucket.pop(k) for k in gone]
            for k in [k for k in written if namespace in (None, k[0])]:
                written.pop(k)  # the listing is newer than any write before it
            for k in gone:
                self._seen.pop((plural, k), None)
            bucket.update(fresh)
            for k, obj in fresh.items():
                self._seen.setdefault((plural, k), collections.deque(maxlen=16)).append(_rv(obj))
            self._primed.add(plural)
        return vanished

    def observe(self, plural: str, event: str | None, obj: Mapping[str, Any]) -> None:
        """A watch event (ADDED, MODIFIED, DELETED; kopf's None: the initial listing)."""
        key = _key(obj)
        with self._lock:
            bucket = self._watched.setdefault(plural, {})
            written = self._written.setdefault(plural, {})
            if event == "DELETED":
                bucket.pop(key, None)
                written.pop(key, None)
                self._seen.pop((plural, key), None)
                return
            bucket[key] = copy.deepcopy(dict(obj))
            self._seen.setdefault((plural, key), collections.deque(maxlen=16)).append(_rv(obj))
            if key in written and _rv(written[key]) == _rv(obj):
                written.pop(key)  # the watch has caught up with our write

    def wrote(self, plural: str, obj: Mapping[str, Any]) -> None:
        """The API server's answer to one of our writes (primed kinds only)."""
        key = _key(obj)
        with self._lock:
            if plural not in self._primed:
                return
            if _rv(obj) in self._seen.get((plural, key), ()):
                return  # delivered already (or a no-op write: the watched copy is this one)
            self._written.setdefault(plural, {})[key] = copy.deepcopy(dict(obj))

    def forget(self, plural: str, namespace: str, name: str) -> None:
        with self._lock:
            self._watched.get(plural, {}).pop((namespace, name), None)
            self._written.get(plural, {}).pop((namespace, name), None)

    def _current_locked(self, plural: str) -> dict[Key, Json]:
        return {**self._watched.get(plural, {}), **self._written.get(plural, {})}

    def get(self, plural: str, namespace: str | None, name: str) -> Json | None:
        with self._lock:
            self.hits += 1
            obj = self._current_locked(plural).get((namespace or "", name))
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, plural: str, namespace: str | None, selector: str | None) -> list[Json]:
        wanted = _selector(selector)
        with self._lock:
            self.hits += 1
            return [
                copy.deepcopy(obj)
                for (ns, _), obj in sorted(self._current_locked(plural).items())
                if (not namespace or ns == namespace)
                and all(
                    ((obj.get("metadata") or {}).get("labels") or {}).get(k) == v
                    for k, v in wanted.items()
                )
            ]
