"""Server-side apply and field ownership (`metadata.managedFields`). Pure functions.

Every write records which fields its manager set, as the API server does: an apply owns the
fields in its configuration (operation `Apply`); any other write owns the fields it changed
(operation `Update`), taking them from their previous owners. An apply then

* conflicts (409, naming the other manager and the field) when it sets a field another
  manager owns to a different value — unless `force`, which takes the field over;
* removes the fields its manager applied last time and no longer sets, unless another
  manager still owns them;
* merges its configuration in: maps field by field, lists of named things (containers,
  env, ports, … — `MERGE_KEYS`) item by item, every other list and scalar whole.

Field sets are sets of paths; a path step is `f:<field>` or, for a keyed list item,
`k:<json of its key>` — the encoding of `fieldsV1`. Lists other than keyed ones are atomic.
"""

from __future__ import annotations

import copy
import datetime
import json
from dataclasses import dataclass
from typing import Any

from kvfleet_localcluster.patches import MERGE_KEYS

Json = dict[str, Any]
FieldPath = tuple[str, ...]
IGNORED_META = {
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "managedFields",
    "deletionTimestamp",
    "selfLink",
    "namespace",
}


class ApplyConflict(Exception):
    def __init__(self, conflicts: list[tuple[str, FieldPath]]) -> None:
        self.conflicts = conflicts
        text = "; ".join(f'conflict with "{m}": {dotted(p)}' for m, p in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflict(s): {text}")


def dotted(path: FieldPath) -> str:
    out = ""
    for step in path:
        kind, _, rest = step.partition(":")
        out += f".{rest}" if kind == "f" else f"[{rest}]"
    return out.lstrip(".")


def _item_key(name: str, item: Any) -> str | None:
    key = MERGE_KEYS.get(name)
    if key is None or not isinstance(item, dict) or key not in item:
        return None
    return "k:" + json.dumps({key: item[key]}, separators=(",", ":"))


def field_set(obj: Any) -> set[FieldPath]:
    """The leaf paths an object sets (status and server-set metadata excluded)."""
    out: set[FieldPath] = set()

    def walk(value: Any, path: FieldPath, name: str) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(v, (*path, f"f:{k}"), k)
        elif isinstance(value, list) and value and all(_item_key(name, i) for i in value):
            for item in value:
                item_path = (*path, _item_key(name, item) or "")
                out.add(item_path)  # the item itself ("." in fieldsV1)
                for k, v in item.items():
                    walk(v, (*item_path, f"f:{k}"), k)
        else:
            out.add(path)

    for top, value in obj.items():
        if top in ("apiVersion", "kind", "status"):
            continue
        if top == "metadata" and isinstance(value, dict):
            for k, v in value.items():
                if k not in IGNORED_META:
                    walk(v, ("f:metadata", f"f:{k}"), k)
        else:
            walk(value, (f"f:{top}",), top)
    return out


def _lookup(obj: Any, path: FieldPath) -> tuple[bool, Any]:
    node = obj
    name = ""
    for step in path:
        kind, _, rest = step.partition(":")
        if kind == "f":
            if not isinstance(node, dict) or rest not in node:
                return False, None
            node, name = node[rest], rest
        else:
            if not isinstance(node, list):
                return False, None
            match = [i for i in node if _item_key(name, i) == step]
            if not match:
                return False, None
            node = match[0]
    return True, node


def _remove(obj: Any, path: FieldPath) -> None:
    found, parent = _lookup(obj, path[:-1])
    if not found:
        return
    kind, _, rest = path[-1].partition(":")
    if kind == "f" and isinstance(parent, dict):
        parent.pop(rest, None)
    elif isinstance(parent, list):
        name = path[-2].partition(":")[2] if len(path) > 1 else ""
        parent[:] = [i for i in parent if _item_key(name, i) != path[-1]]


def _merge(live: Any, config: Any, name: str = "") -> Any:
    if isinstance(config, dict) and isinstance(live, dict):
        out = dict(live)
        for k, v in config.items():
            out[k] = _merge(live.get(k), v, k)
        return out
    if (
        isinstance(config, list)
        and isinstance(live, list)
        and all(_item_key(name, i) for i in [*config, *live])
    ):
        by_key = {_item_key(name, i): i for i in live}
        merged = [_merge(by_key.pop(_item_key(name, c), None), c, name) for c in config]
        return merged + list(by_key.values())  # items others own stay, after the applied ones
    return copy.deepcopy(config)


def to_fields_v1(paths: set[FieldPath]) -> Json:
    root: Json = {}
    for path in sorted(paths):
        node = root
        for step in path:
            node = node.setdefault(step, {})
        if path and path[-1].startswith("k:"):
            node.setdefault(".", {})
    return root


def from_fields_v1(fields: Json) -> set[FieldPath]:
    out: set[FieldPath] = set()

    def walk(node: Json, path: FieldPath) -> None:
        children = {k: v for k, v in node.items() if k != "."}
        if ("." in node or not children) and path:
            out.add(path)
        for k, v in children.items():
            walk(v if isinstance(v, dict) else {}, (*path, k))

    walk(fields, ())
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Entry:
    manager: str
    operation: str
    api_version: str
    fields: set[FieldPath]
    subresource: str = ""
    time: str = ""
    """When its manager last wrote (kept as is while its fields do not change)."""

    def to_json(self) -> Json:
        out: Json = {
            "manager": self.manager,
            "operation": self.operation,
            "apiVersion": self.api_version,
            "time": self.time or _now(),
            "fieldsType": "FieldsV1",
            "fieldsV1": to_fields_v1(self.fields),
        }
        if self.subresource:
            out["subresource"] = self.subresource
        return out


def entries(obj: Json) -> list[Entry]:
    return [
        Entry(
            e.get("manager", ""),
            e.get("operation", "Update"),
            e.get("apiVersion", ""),
            from_fields_v1(e.get("fieldsV1") or {}),
            e.get("subresource", ""),
            e.get("time", ""),
        )
        for e in (obj.get("metadata") or {}).get("managedFields") or []
    ]


def _store(obj: Json, managed: list[Entry]) -> None:
    kept = [e.to_json() for e in managed if e.fields]
    if kept:
        obj.setdefault("metadata", {})["managedFields"] = kept
    else:
        (obj.get("metadata") or {}).pop("managedFields", None)


def _changed(old: Json | None, new: Json) -> set[FieldPath]:
    new_fields = field_set(new)
    if old is None:
        return new_fields
    return {p for p in new_fields if _lookup(old, p) != _lookup(new, p)}


def record_update(
    old: Json | None, new: Json, manager: str, api_version: str, subresource: str = ""
) -> None:
    """A non-apply write by `manager`: it owns what it changed; previous owners lose it."""
    managed = entries(old) if old is not None else []
    changed = _changed(old, new)
    for e in managed:
        e.fields -= changed
    wanted = (manager, "Update", subresource)
    mine = next((e for e in managed if (e.manager, e.operation, e.subresource) == wanted), None)
    if mine is None:
        mine = Entry(manager, "Update", api_version, set(), subresource)
        managed.append(mine)
    if changed:
        mine.fields |= changed
        mine.time = _now()
    for e in managed:  # fields no longer in the object are owned by nobody
        e.fields = {p for p in e.fields if _lookup(new, p)[0]}
    _store(new, managed)


def apply(live: Json | None, config: Json, manager: str, api_version: str, force: bool) -> Json:
    """The object after `manager` applies `config` to `live` (None: create); raises
    ApplyConflict."""
    base: Json = copy.deepcopy(live) if live is not None else {}
    managed = entries(base)
    applied = field_set(config)
    mine = next((e for e in managed if (e.manager, e.operation) == (manager, "Apply")), None)
    conflicts: list[tuple[str, FieldPath]] = []
    for e in managed:
        if e is mine:
            continue
        for path in sorted(e.fields & applied):
            if _lookup(base, path) != _lookup(config, path):
                conflicts.append((e.manager, path))
    if conflicts and not force:
        raise ApplyConflict(conflicts)
    if force:
        taken = {p for _, p in conflicts}
        for e in managed:
            if e is not mine:
                e.fields -= taken
    others = set().union(*(e.fields for e in managed if e is not mine))
    if mine is not None:
        for path in sorted(mine.fields - applied - others, key=len, reverse=True):
            _remove(base, path)
    result: Json = _merge(base, {k: v for k, v in config.items() if k != "status"})
    meta = result.setdefault("metadata", {})
    meta.pop("managedFields", None)
    if mine is None:
        mine = Entry(manager, "Apply", api_version, set())
        managed.append(mine)
    if mine.fields != applied or mine.api_version != api_version:
        mine.fields, mine.api_version, mine.time = applied, api_version, _now()
    _store(result, managed)
    return result


def managed_base(old: Json, new: Json) -> Json:
    """The stored object whose managedFields a write starts from. As a real API server: a
    write that sends managedFields different from the stored ones replaces them (how a
    controller moves fields it once wrote by Update to its Apply entry), `[{}]` clears them,
    and an empty list or none keeps the stored ones (clients unaware of the field cannot strip
    it)."""
    sent = (new.get("metadata") or {}).get("managedFields")
    stored = old["metadata"].get("managedFields")
    if not sent or sent == stored:
        return old
    base = copy.deepcopy(old)
    kept = [e for e in sent if e]  # `[{}]`: none
    if kept:
        base["metadata"]["managedFields"] = kept
    else:
        base["metadata"].pop("managedFields", None)
    return base
