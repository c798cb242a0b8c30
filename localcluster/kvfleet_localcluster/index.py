"""The store's indexes: objects by kind, then (namespace, name); and, per kind, by namespace
and by label pair; and by uid and by owner uid. A get is one lookup, a list reads only the
objects its kind, namespace or an equality label term names, and garbage collection finds
dependents without a scan."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

Kind = tuple[str, str]
"""(group, plural)."""
ObjectKey = tuple[str, str]
"""(namespace or "", name) within one kind."""
FullKey = tuple[str, str, str, str]
"""(group, plural, namespace or "", name)."""
Json = dict[str, Any]


@dataclass
class ObjectIndex:
    objects: dict[Kind, dict[ObjectKey, Json]] = field(default_factory=dict)
    by_namespace: dict[Kind, dict[str, set[ObjectKey]]] = field(default_factory=dict)
    by_label: dict[Kind, dict[tuple[str, str], set[ObjectKey]]] = field(default_factory=dict)
    by_uid: dict[str, FullKey] = field(default_factory=dict)
    dependents: dict[str, set[FullKey]] = field(default_factory=dict)
    """Owner uid → objects whose ownerReferences name it."""

    def lookup(self, key: FullKey) -> Json | None:
        return self.objects.get(key[:2], {}).get(key[2:])

    def has_uid(self, uid: str) -> bool:
        return uid in self.by_uid

    def put(self, key: FullKey, obj: Json) -> None:
        self.remove(key)
        kind, okey = key[:2], key[2:]
        self.objects.setdefault(kind, {})[okey] = obj
        self.by_namespace.setdefault(kind, {}).setdefault(key[2], set()).add(okey)
        meta = obj["metadata"]
        labels = self.by_label.setdefault(kind, {})
        for pair in (meta.get("labels") or {}).items():
            labels.setdefault(pair, set()).add(okey)
        self.by_uid[meta["uid"]] = key
        for ref in meta.get("ownerReferences") or []:
            self.dependents.setdefault(ref.get("uid", ""), set()).add(key)

    def remove(self, key: FullKey) -> Json | None:
        kind, okey = key[:2], key[2:]
        old = self.objects.get(kind, {}).pop(okey, None)
        if old is None:
            return None
        self.by_namespace.get(kind, {}).get(key[2], set()).discard(okey)
        meta = old["metadata"]
        labels = self.by_label.get(kind, {})
        for pair in (meta.get("labels") or {}).items():
            holders = labels.get(pair)
            if holders is not None:
                holders.discard(okey)
                if not holders:
                    del labels[pair]
        self.by_uid.pop(meta["uid"], None)
        for ref in meta.get("ownerReferences") or []:
            deps = self.dependents.get(ref.get("uid", ""))
            if deps is not None:
                deps.discard(key)
                if not deps:
                    del self.dependents[ref.get("uid", "")]
        return old

    def peek(self, kind: Kind, ns: str | None) -> list[Json]:
        objs = self.objects.get(kind, {})
        if ns is None:
            return list(objs.values())
        return [objs[k] for k in self.by_namespace.get(kind, {}).get(ns, ())]

    def candidates(
        self, kind: Kind, ns: str | None, equal_labels: list[tuple[str, str]]
    ) -> list[Json]:
        """The objects a list may return, sorted by (namespace, name): narrowed by namespace
        and by the first equality label term; the caller checks the full selectors."""
        objs = self.objects.get(kind, {})
        keys: Iterable[ObjectKey] = objs.keys()
        if ns:
            keys = self.by_namespace.get(kind, {}).get(ns, set())
        if equal_labels:
            labelled = self.by_label.get(kind, {}).get(equal_labels[0], set())
            keys = [k for k in labelled if k in objs and (not ns or k[0] == ns)]
        return [objs[k] for k in sorted(keys)]

    def dependents_of(self, uid: str) -> Iterator[tuple[FullKey, Json]]:
        for key in sorted(self.dependents.get(uid, ())):
            obj = self.lookup(key)
            if obj is not None:
                yield key, obj
