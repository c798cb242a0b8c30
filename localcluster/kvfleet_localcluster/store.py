"""The API server's object store with Kubernetes semantics. Pure and synchronous.

resourceVersion (one counter for the whole store, bumped on every write, carried by objects,
lists and watch events), uid, creationTimestamp, generation (bumped when anything but
metadata and status changes), conflicts (409) on existing names and stale resourceVersions,
status and scale subresources kept apart from the main object, generateName, finalizers,
ownerReference garbage collection (background cascade), and a bounded event history per
resource so a watch can resume from a resourceVersion — or get 410 Gone when it is too old.
Every write can be a dry run (validated and admitted, never stored) and names its field
manager; server-side apply and `managedFields` are `ssa.py`'s, kinds and errors `apitypes.py`'s;
lookups go through `index.py`.
"""

from __future__ import annotations

import base64
import copy
import datetime
import secrets
import string
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from kvfleet_localcluster import ssa
from kvfleet_localcluster.apitypes import ApiError, Gone, Kind
from kvfleet_localcluster.index import FullKey, ObjectIndex
from kvfleet_localcluster.patches import (
    PatchError,
    equality_terms,
    field_matcher,
    json_patch,
    label_matcher,
    merge_patch,
    strategic_merge_patch,
)

HISTORY = 10_000
SERVER_MANAGER = "kvfleet-local"
"""The field manager of writes that name none (the local cluster's own controllers)."""
PatchType = Literal["merge", "json", "strategic", "apply"]


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _path_get(obj: dict[str, Any], path: str) -> Any:
    node: Any = obj
    for part in path.strip(".").split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _path_set(obj: dict[str, Any], path: str, value: Any) -> None:
    parts = path.strip(".").split(".")
    node = obj
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _secret_string_data(kind: Kind, obj: dict[str, Any]) -> None:
    """A Secret's `stringData` is write-only: the API server folds it into `data` (base64)."""
    if kind.kind == "Secret" and obj.get("stringData"):
        data = obj.setdefault("data", {}) or {}
        for key, value in obj.pop("stringData").items():
            data[key] = base64.b64encode(str(value).encode()).decode()
        obj["data"] = data


def _body(obj: dict[str, Any]) -> dict[str, Any]:
    """What `generation` tracks: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


HistoryEntry = tuple[int, str, dict[str, Any], dict[str, Any] | None]
"""(resourceVersion, event type, object, the object before a MODIFIED event)."""


@dataclass
class Store:
    index: ObjectIndex = field(default_factory=lambda: ObjectIndex())
    """Objects by kind, namespace, name, label pair, uid and owner."""
    rv: int = 0
    history: dict[tuple[str, str], deque[HistoryEntry]] = field(default_factory=dict)
    listeners: list[Callable[[Kind, str, dict[str, Any]], None]] = field(default_factory=list)
    kinds: dict[tuple[str, str], Kind] = field(default_factory=dict)
    admission: list[Callable[[Kind, dict[str, Any], str | None], None]] = field(
        default_factory=list
    )
    """Called with (kind, object, subresource) before every create and update is stored; may
    default fields in place or raise ApiError (422) to refuse the write."""
    history_size: int = HISTORY
    """Events kept per resource for watches resuming from a resourceVersion."""

    # ---- bookkeeping ----------------------------------------------------------------------
    def _bump(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _emit(
        self, kind: Kind, event: str, obj: dict[str, Any], previous: dict[str, Any] | None = None
    ) -> None:
        """Record an event; a MODIFIED one keeps the object before it (`previous`), which a
        filtered watch needs to see an object enter or leave its selector."""
        self.history.setdefault(kind.key, deque(maxlen=self.history_size)).append(
            (int(obj["metadata"]["resourceVersion"]), event, copy.deepcopy(obj), previous)
        )
        for listener in self.listeners:
            listener(kind, event, obj)

    def _key(self, kind: Kind, ns: str | None, name: str) -> FullKey:
        return kind.group, kind.plural, (ns or "") if kind.namespaced else "", name

    def _find(self, kind: Kind, ns: str | None, name: str) -> dict[str, Any]:
        obj = self.index.lookup(self._key(kind, ns, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{kind.plural} "{name}" not found')
        return obj

    def peek(self, group: str, plural: str, ns: str | None = None) -> list[dict[str, Any]]:
        """The stored objects of a kind, not copies: for in-process readers (RBAC, the
        kubelet) that only read. Nothing may modify what this returns."""
        return self.index.peek((group, plural), ns)

    def lookup(self, kind: tuple[str, str], ns: str, name: str) -> dict[str, Any] | None:
        """One stored object, not a copy (read-only, as `peek`)."""
        return self.index.lookup((*kind, ns, name))

    def owned_by(self, uid: str, kind: tuple[str, str]) -> list[dict[str, Any]]:
        """The stored objects of `kind` whose ownerReferences name `uid` (read-only)."""
        return [obj for key, obj in self.index.dependents_of(uid) if key[:2] == kind]

    def exists(self, group: str, plural: str, ns: str, name: str) -> bool:
        return self.index.lookup((group, plural, ns, name)) is not None

    # ---- reads ----------------------------------------------------------------------------
    def get(self, kind: Kind, ns: str | None, name: str) -> dict[str, Any]:
        return copy.deepcopy(self._find(kind, ns, name))

    def list_objects(
        self, kind: Kind, ns: str | None, labels: str | None = None, fields: str | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        try:
            match_labels, match_fields = label_matcher(labels), field_matcher(fields)
        except ValueError as exc:
            raise ApiError(400, "BadRequest", str(exc)) from exc
        items = [
            copy.deepcopy(obj)
            for obj in self.index.candidates(kind.key, ns, equality_terms(labels))
            if match_labels(obj["metadata"].get("labels") or {}) and match_fields(obj)
        ]
        return items, str(self.rv)

    def events_since(
        self, kind: Kind, ns: str | None, rv: str | None, labels: str | None, fields: str | None
    ) -> tuple[list[tuple[str, dict[str, Any]]], int]:
        """Events a watch from `rv` must send first (ADDED for all when rv is unset or "0")."""
        match_labels, match_fields = label_matcher(labels), field_matcher(fields)

        def wanted(o: dict[str, Any]) -> bool:
            return (
                (not ns or o["metadata"].get("namespace") == ns)
                and match_labels(o["metadata"].get("labels") or {})
                and match_fields(o)
            )

        if not rv or rv == "0":
            items, _ = self.list_objects(kind, ns, labels, fields)
            return [("ADDED", o) for o in items], self.rv
        try:
            since = int(rv)
        except ValueError:
            raise ApiError(400, "BadRequest", f"invalid resourceVersion {rv!r}") from None
        log = self.history.get(kind.key, deque())
        if log and since < log[0][0] - 1 and len(log) == log.maxlen:
            raise Gone(rv)
        tail = []
        for r, e, o, before in reversed(log):  # only what is newer than `since`: a short walk
            if r <= since:
                break
            now_in = wanted(o)
            if e != "MODIFIED" or before is None or now_in == wanted(before):
                if now_in:
                    tail.append((e, o))
            elif now_in:  # it entered the selector: new to this watch
                tail.append(("ADDED", o))
            else:  # it left: gone for this watch (as it was, at this resourceVersion)
                left = copy.deepcopy(before)
                left["metadata"]["resourceVersion"] = str(r)
                tail.append(("DELETED", left))
        tail.reverse()
        return tail, self.rv

    # ---- writes ---------------------------------------------------------------------------
    def create(
        self,
        kind: Kind,
        ns: str | None,
        obj: dict[str, Any],
        dry_run: bool = False,
        manager: str = SERVER_MANAGER,
        applied: bool = False,
    ) -> dict[str, Any]:
        """Store a new object. `dry_run`: validate, default and admit it, return what would be
        stored, store nothing and tell no watcher (the API server's `dryRun=All`)."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", "metadata.name or generateName is required")
            alphabet = string.ascii_lowercase + string.digits
            meta["name"] = meta["generateName"] + "".join(
                secrets.choice(alphabet) for _ in range(5)
            )
        if kind.namespaced:
            if meta.get("namespace") and ns and meta["namespace"] != ns:
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the object does not match the namespace of the request",
                )
            meta["namespace"] = ns or meta.get("namespace") or "default"
        key = self._key(kind, meta.get("namespace"), meta["name"])
        if self.index.lookup(key) is not None:
            raise ApiError(409, "AlreadyExists", f'{kind.plural} "{meta["name"]}" already exists')
        obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
        _secret_string_data(kind, obj)
        for admit in self.admission:
            admit(kind, obj, None)
        if not applied:  # an apply recorded its own fields
            meta.pop("managedFields", None)
            ssa.record_update(None, obj, manager, kind.api_version)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        if dry_run:
            return obj
        meta["resourceVersion"] = self._bump()
        self.index.put(key, obj)
        self._emit(kind, "ADDED", obj)
        created = copy.deepcopy(obj)
        owners = {r.get("uid", "") for r in meta.get("ownerReferences") or []}
        if owners and not any(self.index.has_uid(uid) for uid in owners):
            # As the garbage collector does: a dependent whose owners are all gone (deleted
            # while it was being created) is collected; the create itself succeeded.
            self.delete(kind, meta.get("namespace"), meta["name"])
        return created

    def _commit(
        self,
        kind: Kind,
        old: dict[str, Any],
        new: dict[str, Any],
        subresource: str | None,
        dry_run: bool = False,
        manager: str = SERVER_MANAGER,
        applied: bool = False,
        recorded_as: str = "",
    ) -> dict[str, Any]:
        """Store `new` in place of `old` with the subresource rules; bump versions; record
        what `manager` changed (unless an apply already recorded its fields), under the
        subresource it wrote through (`recorded_as`: scale)."""
        meta_old = old["metadata"]
        if subresource == "status":
            merged = copy.deepcopy(old)
            merged["status"] = new.get("status")
            new = merged
        else:
            if "status" in kind.subresources:
                new["status"] = copy.deepcopy(old.get("status"))
                if new["status"] is None:
                    new.pop("status")
            meta = new.setdefault("metadata", {})
            for fixed in ("uid", "creationTimestamp", "namespace", "name"):
                if fixed in meta_old:
                    meta[fixed] = meta_old[fixed]
            meta["generation"] = meta_old.get("generation", 1) + (
                1 if _body(new) != _body(old) else 0
            )
            if meta_old.get("deletionTimestamp"):
                meta["deletionTimestamp"] = meta_old["deletionTimestamp"]
        new["apiVersion"], new["kind"] = kind.api_version, kind.kind
        _secret_string_data(kind, new)
        for admit in self.admission:
            admit(kind, new, subresource)
        if subresource != "status" and not applied:
            base = ssa.managed_base(old, new)
            new["metadata"]["managedFields"] = copy.deepcopy(base["metadata"].get("managedFields"))
            ssa.record_update(base, new, manager, kind.api_version, recorded_as)
        if new == old:
            return copy.deepcopy(old)  # no-op writes change nothing, not even resourceVersion
        if dry_run:
            return new
        new["metadata"]["resourceVersion"] = self._bump()
        key = self._key(kind, meta_old.get("namespace"), meta_old["name"])
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            self.index.remove(key)
            self._emit(kind, "DELETED", new)
            self._collect(new["metadata"]["uid"])
        else:
            self.index.put(key, new)
            self._emit(kind, "MODIFIED", new, old)
        return copy.deepcopy(new)

    def replace(
        self,
        kind: Kind,
        ns: str | None,
        name: str,
        obj: dict[str, Any],
        subresource: str | None = None,
        dry_run: bool = False,
        manager: str = SERVER_MANAGER,
    ) -> dict[str, Any]:
        old = self._find(kind, ns, name)
        given = (obj.get("metadata") or {}).get("resourceVersion")
        if given and given != old["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f"Operation cannot be fulfilled on {kind.plural} "
                f'"{name}": the object has been modified; please apply your changes '
                "to the latest version and try again",
            )
        if subresource == "scale":
            return self.set_scale(kind, ns, name, obj, dry_run, manager)
        return self._commit(kind, old, copy.deepcopy(obj), subresource, dry_run, manager)

    def patch(
        self,
        kind: Kind,
        ns: str | None,
        name: str,
        patch_type: PatchType,
        patch: Any,
        subresource: str | None = None,
        dry_run: bool = False,
        manager: str = SERVER_MANAGER,
        force: bool = False,
    ) -> dict[str, Any]:
        if patch_type == "apply":
            return self._server_side_apply(kind, ns, name, patch, dry_run, manager, force)
        old = self._find(kind, ns, name)
        if subresource == "scale":
            current = self.get_scale(kind, ns, name)
            scale = self._apply(current, patch_type, patch)
            return self.set_scale(kind, ns, name, scale, dry_run, manager)
        new = self._apply(copy.deepcopy(old), patch_type, patch)
        given = (
            (patch.get("metadata") or {}).get("resourceVersion")
            if isinstance(patch, dict)
            else None
        )
        if given and given != old["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'the object "{name}" has been modified')
        return self._commit(kind, old, new, subresource, dry_run, manager)

    def _server_side_apply(
        self,
        kind: Kind,
        ns: str | None,
        name: str,
        config: Any,
        dry_run: bool,
        manager: str,
        force: bool,
    ) -> dict[str, Any]:
        if not isinstance(config, dict):
            raise ApiError(400, "BadRequest", "an apply configuration must be an object")
        if not manager:
            raise ApiError(
                400, "BadRequest", "PATCH of type apply requires the fieldManager parameter"
            )
        live = self.index.lookup(self._key(kind, ns, name))
        try:
            new = ssa.apply(live, config, manager, kind.api_version, force)
        except ssa.ApplyConflict as conflict:
            raise ApiError(409, "Conflict", str(conflict)) from None
        if live is None:  # apply creates what does not exist
            new.setdefault("metadata", {})["name"] = name
            return self.create(kind, ns, new, dry_run, manager, applied=True)
        return self._commit(kind, live, new, None, dry_run, manager, applied=True)

    @staticmethod
    def _apply(doc: dict[str, Any], patch_type: PatchType, patch: Any) -> dict[str, Any]:
        try:
            if patch_type == "json":
                result = json_patch(doc, patch)
            elif patch_type == "strategic":
                result = strategic_merge_patch(doc, patch)
            else:
                result = merge_patch(doc, patch)
        except PatchError as exc:
            raise ApiError(422, "Invalid", str(exc)) from exc
        if not isinstance(result, dict):
            raise ApiError(422, "Invalid", "the patch does not produce an object")
        return result

    def delete(
        self,
        kind: Kind,
        ns: str | None,
        name: str,
        propagation: str = "Background",
        dry_run: bool = False,
    ) -> dict[str, Any]:
        obj = self._find(kind, ns, name)
        meta = obj["metadata"]
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                new = copy.deepcopy(obj)
                new["metadata"]["deletionTimestamp"] = _now()
                if dry_run:
                    return new
                new["metadata"]["resourceVersion"] = self._bump()
                self.index.put(self._key(kind, meta.get("namespace"), name), new)
                self._emit(kind, "MODIFIED", new, obj)
                return copy.deepcopy(new)
            return copy.deepcopy(obj)
        if dry_run:
            return copy.deepcopy(obj)
        self.index.remove(self._key(kind, meta.get("namespace"), name))
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = self._bump()
        self._emit(kind, "DELETED", gone)
        if propagation != "Orphan":
            self._collect(meta["uid"])
        else:
            self._orphan(meta["uid"])
        return gone

    def _dependents(self, uid: str) -> list[tuple[Kind, dict[str, Any]]]:
        return [(self.kinds[key[:2]], obj) for key, obj in self.index.dependents_of(uid)]

    def _collect(self, uid: str) -> None:
        """Garbage-collect what the deleted owner owned (background cascading deletion)."""
        for kind, o in self._dependents(uid):
            meta = o["metadata"]
            if self.index.lookup(self._key(kind, meta.get("namespace"), meta["name"])) is not None:
                self.delete(kind, meta.get("namespace"), meta["name"])

    def _orphan(self, uid: str) -> None:
        for kind, o in self._dependents(uid):
            refs = [r for r in o["metadata"]["ownerReferences"] if r.get("uid") != uid]
            self.patch(
                kind,
                o["metadata"].get("namespace"),
                o["metadata"]["name"],
                "merge",
                {"metadata": {"ownerReferences": refs or None}},
            )

    # ---- scale ----------------------------------------------------------------------------
    def get_scale(self, kind: Kind, ns: str | None, name: str) -> dict[str, Any]:
        if "scale" not in kind.subresources:
            raise ApiError(404, "NotFound", f"{kind.plural} has no scale subresource")
        obj = self._find(kind, ns, name)
        meta = obj["metadata"]
        selector = _path_get(obj, kind.selector_path) if kind.selector_path else None
        if isinstance(selector, dict):  # a LabelSelector object (deployments)
            selector = ",".join(f"{k}={v}" for k, v in (selector.get("matchLabels") or {}).items())
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in meta
            },
            "spec": {"replicas": _path_get(obj, kind.spec_replicas_path) or 0},
            "status": {
                "replicas": _path_get(obj, kind.status_replicas_path) or 0,
                **({"selector": selector} if selector else {}),
            },
        }

    def set_scale(
        self,
        kind: Kind,
        ns: str | None,
        name: str,
        scale: dict[str, Any],
        dry_run: bool = False,
        manager: str = SERVER_MANAGER,
    ) -> dict[str, Any]:
        if "scale" not in kind.subresources:
            raise ApiError(404, "NotFound", f"{kind.plural} has no scale subresource")
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ApiError(422, "Invalid", "spec.replicas must be a non-negative integer")
        old = self._find(kind, ns, name)
        new = copy.deepcopy(old)
        _path_set(new, kind.spec_replicas_path, replicas)
        # Recorded as the writer's, through the scale subresource (`kubectl scale` then
        # owns spec.replicas, as on a real server).
        self._commit(kind, old, new, None, dry_run, manager, recorded_as="scale")
        result = self.get_scale(kind, ns, name)
        if dry_run:
            result["spec"]["replicas"] = replicas
        return result
