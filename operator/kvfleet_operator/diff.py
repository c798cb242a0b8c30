"""Pure comparison of what the operator renders with what the cluster holds.

Children are written by server-side apply (the API server merges, removes and arbitrates);
this module only decides whether an apply is due, so a steady state sends nothing. One is
due when a field the operator renders differs from the live object (fields the API server
or other controllers add — defaults, status, clusterIP, other tools' annotations — are not
compared; keyed lists — containers, env, volumes, ports — item by item as server-side apply
merges them, other lists whole, so a container edited by hand is put back and a webhook's
extra env var is left alone), or when the live object's `managedFields` say the operator
owns a field it no longer renders (applying again removes it), or when the operator has
never applied it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from kvfleet_kernel.schema import Json
from kvfleet_operator.render.common import GROUP_INDEX_LABEL, ROLE_LABEL
from kvfleet_operator.scaling.policy import shrink_order
from kvfleet_operator.status import pod_ready

OWNED_METADATA = ("labels", "annotations", "ownerReferences")


def _quantity_equal(want: Any, have: Any) -> bool:
    # The API server may return 4 for "4"; the values we render are canonical otherwise.
    return isinstance(want, str | int) and isinstance(have, str | int) and str(want) == str(have)


MAP_LIST_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "ports": ("containerPort", "port"),
    "imagePullSecrets": ("name",),
    "ownerReferences": ("uid",),
}
"""Lists the API server merges item by item under server-side apply (`listType: map` in
Kubernetes' OpenAPI, keyed by these fields): another manager's items beside ours (a webhook's
env var or sidecar, a mesh's volume) are theirs, not drift. Every other list is atomic."""


ATOMIC_MAPS = frozenset({"nodeSelector", "selector"})
"""Maps the API server replaces whole (`mapType: atomic`: a pod's nodeSelector, a Service's
selector): a key another writer added beside ours is drift the next apply removes, not
another manager's entry to leave alone. (A LabelSelector, also under `selector`, is a struct
of maps, compared as any other.)"""


def _atomic_map(want: Any, field: str) -> bool:
    return (
        field in ATOMIC_MAPS
        and isinstance(want, dict)
        and all(isinstance(v, str) for v in want.values())
    )


def _item_key(item: Any, keys: tuple[str, ...]) -> tuple[str, Any] | None:
    if isinstance(item, dict):
        for key in keys:
            if key in item:
                return key, item[key]
    return None


def _covers_map_list(have: list[Any], want: list[Any], keys: tuple[str, ...]) -> bool:
    by_key = {k: h for h in have if (k := _item_key(h, keys)) is not None}
    for w in want:
        key = _item_key(w, keys)
        if key is None or key not in by_key or not covers(by_key[key], w):
            return False
    return True


def covers(have: Any, want: Any, field: str = "") -> bool:
    """True when `have` holds everything `want` says (dicts: a superset; keyed lists — see
    `MAP_LIST_KEYS` — each wanted item present and covered; other lists: same length,
    element by element; `ATOMIC_MAPS`: equal). `field` is the name `want` is found under."""
    if _atomic_map(want, field):
        return isinstance(have, dict) and have == want
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            k in have and covers(have[k], v, k) for k, v in want.items()
        )
    if isinstance(want, list):
        if not isinstance(have, list):
            return False
        keys = MAP_LIST_KEYS.get(field)
        if keys is not None and all(_item_key(w, keys) is not None for w in want):
            return _covers_map_list(have, want, keys)
        return len(have) == len(want) and all(covers(h, w) for h, w in zip(have, want, strict=True))
    return want == have or (type(want) is not type(have) and _quantity_equal(want, have))


def owned_part(obj: Json) -> Json:
    """The part of a rendered object the operator owns: everything but identity."""
    out = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    meta = obj.get("metadata") or {}
    out["metadata"] = {k: meta[k] for k in OWNED_METADATA if k in meta}
    return out


FieldPath = tuple[str, ...]


def _leaf_paths(node: Any, path: FieldPath, out: list[FieldPath]) -> None:
    children = {k: v for k, v in node.items() if k != "."} if isinstance(node, dict) else {}
    if path and (not children or "." in node):
        out.append(path)  # a leaf, or a keyed item owned as a whole (".")
    for step, sub in children.items():
        _leaf_paths(sub, (*path, step), out)


def _managed(live: Json) -> list[Json]:
    return (live.get("metadata") or {}).get("managedFields") or []


def _is_own(entry: Json, manager: str, operation: str) -> bool:
    """`entry` records `manager`'s writes of the object itself (not a subresource) by
    `operation` (Apply or Update)."""
    mine = (entry.get("manager"), entry.get("operation")) == (manager, operation)
    return mine and not entry.get("subresource")


def applied_fields(live: Json, manager: str) -> list[FieldPath] | None:
    """The paths `manager` owns by apply in `live`'s `managedFields` (the `fieldsV1` steps:
    `f:<field>`, `k:<json key>`, `v:<json value>`, `i:<index>`); None: it never applied
    this object."""
    for entry in _managed(live):
        if _is_own(entry, manager, "Apply"):
            out: list[FieldPath] = []
            _leaf_paths(entry.get("fieldsV1") or {}, (), out)
            return out
    return None


def upgraded_managed_fields(live: Json, manager: str) -> list[Json] | None:
    """`live`'s managedFields with `manager`'s Update entry folded into its Apply entry, or
    None when there is no such Update entry. An earlier kvfleet wrote its children by merge
    patch (an Update); until those fields move to the Apply entry, the server keeps them for
    that Update even after the operator stops rendering them (client-go's csaupgrade does
    the same move)."""
    managed = _managed(live)
    updates = [e for e in managed if _is_own(e, manager, "Update")]
    if not updates:
        return None
    applied = next((e for e in managed if _is_own(e, manager, "Apply")), None)
    fields: Json = {}
    for e in [*updates, *([applied] if applied else [])]:
        fields = _union(fields, e.get("fieldsV1") or {})
    merged = {
        **(applied or updates[-1]),
        "operation": "Apply",
        "fieldsType": "FieldsV1",
        "fieldsV1": fields,
    }
    rest = [e for e in managed if e is not applied and not _is_own(e, manager, "Update")]
    return [*rest, merged]


def adopted_managed_fields(live: Json, manager: str) -> list[Json]:
    """`live`'s managedFields with every manager's entry for the object itself folded into
    one Apply entry of `manager`: an adopted object becomes wholly the operator's, so its
    next apply drops what it does not render (a user's unnamed Service port beside the
    operator's named ones made every apply a 422). Subresource entries (status) stay."""
    managed = _managed(live)
    whole = [e for e in managed if not e.get("subresource")]
    fields: Json = {}
    for e in whole:
        fields = _union(fields, e.get("fieldsV1") or {})
    base = whole[-1] if whole else {"apiVersion": live.get("apiVersion")}
    merged = {**base, "manager": manager, "operation": "Apply", "fieldsType": "FieldsV1",
              "fieldsV1": fields}  # fmt: skip
    return [*(e for e in managed if e.get("subresource")), merged]


def _union(a: Json, b: Json) -> Json:
    out = dict(a)
    for k, v in b.items():
        out[k] = _union(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def field_owners(live: Json, path: FieldPath) -> list[str]:
    """The managers whose `managedFields` entries own the field at `path` (a `fieldsV1`
    path: `("f:spec", "f:replicas")`), with the subresource they wrote through."""
    out: list[str] = []
    for entry in (live.get("metadata") or {}).get("managedFields") or []:
        node: Any = entry.get("fieldsV1") or {}
        for step in path:
            node = node.get(step) if isinstance(node, dict) else None
        if node is not None:
            sub = entry.get("subresource")
            out.append(f"{entry.get('manager')}" + (f" (/{sub})" if sub else ""))
    return out


def _item_matches(item: Any, key: Json) -> bool:
    return isinstance(item, dict) and all(item.get(k) == v for k, v in key.items())


def renders(desired: Json, path: FieldPath) -> bool:
    """Whether `desired` holds the field a `fieldsV1` path names."""
    node: Any = desired
    for step in path:
        kind, _, rest = step.partition(":")
        if kind == "f" and isinstance(node, dict) and rest in node:
            node = node[rest]
        elif kind == "k" and isinstance(node, list):
            key = json.loads(rest)
            node = next((i for i in node if _item_matches(i, key)), None)
            if node is None:
                return False
        elif kind == "v" and isinstance(node, list):
            return json.loads(rest) in node
        elif kind == "i" and isinstance(node, list) and rest.isdigit() and int(rest) < len(node):
            node = node[int(rest)]
        else:
            return False
    return True


def needs_apply(desired: Json, live: Json | None, manager: str) -> bool:
    """Whether applying `desired` could change `live` (None: it does not exist)."""
    if live is None or not covers(live, owned_part(desired)):
        return True
    owned = applied_fields(live, manager)
    return owned is None or not all(renders(desired, path) for path in owned)


def own_resize(desired: Json, live: Json | None, manager: str) -> tuple[int, int] | None:
    """(live replicas, rendered replicas) when the only rendered field that differs is
    `spec.replicas` and no other manager owns it: the operator resizing its own workload (an
    autoscaler decision, a pool shrinking), not drift. None otherwise: nothing to apply, other
    fields changed too, or someone else scaled it (`kubectl scale` owns the field then)."""
    want = (desired.get("spec") or {}).get("replicas")
    have = ((live or {}).get("spec") or {}).get("replicas")
    if live is None or not isinstance(want, int) or not isinstance(have, int) or want == have:
        return None
    if any(m.split(" ")[0] != manager for m in field_owners(live, ("f:spec", "f:replicas"))):
        return None
    same = {**live, "spec": {**live["spec"], "replicas": want}}
    return None if needs_apply(desired, same, manager) else (have, want)


def warm_assignment(
    pods: list[Json],
    warm_target: int,
    active_target: int,
    in_flight: Mapping[str, float] | None = None,
) -> dict[str, str]:
    """Which ready engine pods are warm spares: pods beyond `active_target`, up to
    `warm_target`, preferring pods already warm (no churn), then the active ones a shrinking
    fleet demotes first (`shrink_order`: the fewest requests in flight by `in_flight`, pod
    name -> running + queued; a pod it lacks counts as busy; then the newest). Traffic comes
    first: while fewer than `active_target` are ready, every ready pod is active.
    Returns pod name → role for every ready pod."""
    ready = [p for p in pods if pod_ready(p)]
    warm_count = max(0, min(warm_target, len(ready) - active_target))

    def created(p: Json) -> tuple[int, str]:
        # LeaderWorkerSet groups go from the highest index down: those are the spares.
        group = (p["metadata"].get("labels") or {}).get(GROUP_INDEX_LABEL, "0")
        return int(group) if group.isdigit() else 0, str(p["metadata"].get("creationTimestamp", ""))

    def not_warm(p: Json) -> bool:
        return (p["metadata"].get("labels") or {}).get(ROLE_LABEL) != "warm"

    # Newest first. LeaderWorkerSet groups: the highest groups, always — LWS scales down from
    # the top, so a warm spare anywhere else could never be the one removed (a swap of roles
    # is the lesser cost). Otherwise the pods already warm, then the active ones in the
    # order a shrinking fleet demotes them.
    ranked = sorted(ready, key=created, reverse=True)
    if not any(GROUP_INDEX_LABEL in (p["metadata"].get("labels") or {}) for p in ready):
        loads = in_flight or {}
        active = [p for p in ranked if not_warm(p)]
        order = shrink_order(
            [loads.get(p["metadata"]["name"], math.inf) if loads else 0.0 for p in active],
            [-i for i in range(len(active))],  # `ranked` is newest first
        )
        ranked = [p for p in ranked if not not_warm(p)] + [active[i] for i in order]
    warm = {p["metadata"]["name"] for p in ranked[:warm_count]}
    return {
        p["metadata"]["name"]: "warm" if p["metadata"]["name"] in warm else "active" for p in ready
    }
