"""What the operator's watches already told it, so a steady-state reconcile asks nothing.

A reconcile reads its InferenceService, each child it renders and the engine pods. Read from
the API server, that is a dozen GETs per service per resync — 200 requests/s for 1,000
services at a 60 s resync. The operator already watches every one of those kinds (to react
to drift), so the watches feed this cache and reads are answered from it; the API server
only sees the watches and the writes.

* Primed once per kind by one LIST (the operator's label selector) before kopf's watches
  start, then kept current by every watch event and by the operator's own write responses.
* Newer wins: an event or response is applied only if its resourceVersion is not older than
  what the cache holds, so a late event never rolls an object back.
* A kind that is not primed (not watched here) is read from the API server, as before.
* A write that finds the object gone (404) evicts it (`Kube` does this), so a deletion the
  watch has not delivered yet costs one failed reconcile, never a wrong steady state.

Thread-safe: events arrive on kopf's event loop, reads come from the reconcile worker thread.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable, Mapping
from typing import Any

Json = dict[str, Any]
Key = tuple[str, str]


def _rv(obj: Mapping[str, Any]) -> int | None:
    value = (obj.get("metadata") or {}).get("resourceVersion")
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None  # opaque resourceVersions: order unknown, the latest to arrive wins


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
        self._objects: dict[str, dict[Key, Json]] = {}
        self._primed: set[str] = set()
        self.hits = 0
        """Reads answered here instead of by the API server."""

    def primed(self, plural: str) -> bool:
        with self._lock:
            return plural in self._primed

    def prime(self, plural: str, items: Iterable[Json]) -> None:
        """The result of a LIST: from now on `plural` is answered from the cache."""
        with self._lock:
            bucket = self._objects.setdefault(plural, {})
            for obj in items:
                self._put_locked(bucket, obj)
            self._primed.add(plural)

    def observe(self, plural: str, event: str | None, obj: Mapping[str, Any]) -> None:
        """A watch event (kopf's `type`: None for the initial listing) or a write response."""
        meta = obj.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        with self._lock:
            bucket = self._objects.setdefault(plural, {})
            if event == "DELETED":
                held = bucket.get(key)
                new, old = _rv(obj), _rv(held) if held is not None else None
                if held is None or new is None or old is None or new >= old:
                    bucket.pop(key, None)
                return
            self._put_locked(bucket, copy.deepcopy(dict(obj)))

    def forget(self, plural: str, namespace: str, name: str) -> None:
        with self._lock:
            self._objects.get(plural, {}).pop((namespace, name), None)

    @staticmethod
    def _put_locked(bucket: dict[Key, Json], obj: Json) -> None:
        meta = obj.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        held = bucket.get(key)
        new, old = _rv(obj), _rv(held) if held is not None else None
        if held is None or new is None or old is None or new >= old:
            bucket[key] = obj

    def get(self, plural: str, namespace: str | None, name: str) -> Json | None:
        with self._lock:
            obj = self._objects.get(plural, {}).get((namespace or "", name))
            self.hits += 1
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, plural: str, namespace: str | None, selector: str | None) -> list[Json]:
        wanted = _selector(selector)
        with self._lock:
            self.hits += 1
            out = [
                copy.deepcopy(obj)
                for (ns, _), obj in sorted(self._objects.get(plural, {}).items())
                if (not namespace or ns == namespace)
                and all(
                    ((obj.get("metadata") or {}).get("labels") or {}).get(k) == v
                    for k, v in wanted.items()
                )
            ]
        return out
