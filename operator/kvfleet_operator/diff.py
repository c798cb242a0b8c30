"""Pure comparison of what the operator renders with what the cluster holds.

A child needs a write only when some field the operator renders differs from the live
object. Fields the API server or other controllers add (defaults, status, clusterIP,
annotations of other tools) are ignored, so a second reconcile of an unchanged world writes
nothing; lists the operator renders (containers, env, volumes, ports) are compared whole,
so a container edited or added by hand is put back.
"""

from __future__ import annotations

from typing import Any

from kvfleet_gateway.schema import Json
from kvfleet_operator.render.common import ROLE_LABEL
from kvfleet_operator.status import pod_ready

OWNED_METADATA = ("labels", "annotations", "ownerReferences")


def _quantity_equal(want: Any, have: Any) -> bool:
    # The API server may return 4 for "4"; the values we render are canonical otherwise.
    return isinstance(want, str | int) and isinstance(have, str | int) and str(want) == str(have)


def covers(have: Any, want: Any) -> bool:
    """True when `have` holds everything `want` says (dicts: a superset; lists: same length,
    element by element)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            k in have and covers(have[k], v) for k, v in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(have) == len(want)
            and all(covers(h, w) for h, w in zip(have, want, strict=True))
        )
    return want == have or (type(want) is not type(have) and _quantity_equal(want, have))


def owned_part(obj: Json) -> Json:
    """The part of a rendered object the operator owns: everything but identity."""
    out = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    meta = obj.get("metadata") or {}
    out["metadata"] = {k: meta[k] for k in OWNED_METADATA if k in meta}
    return out


def repair_patch(desired: Json, live: Json | None) -> Json | None:
    """The merge patch that makes `live` hold `desired` (None: nothing to do; live None:
    create instead)."""
    want = owned_part(desired)
    if live is not None and covers(live, want):
        return None
    return want


def warm_assignment(pods: list[Json], warm_target: int, active_target: int) -> dict[str, str]:
    """Which ready engine pods are warm spares: pods beyond `active_target`, up to
    `warm_target`, preferring pods already warm (no churn), then the newest. Traffic comes
    first: while fewer than `active_target` are ready, every ready pod is active.
    Returns pod name → role for every ready pod."""
    ready = [p for p in pods if pod_ready(p)]
    warm_count = max(0, min(warm_target, len(ready) - active_target))

    def created(p: Json) -> str:
        return str(p["metadata"].get("creationTimestamp", ""))

    def not_warm(p: Json) -> bool:
        return (p["metadata"].get("labels") or {}).get(ROLE_LABEL) != "warm"

    # Newest first, then (stable) the pods already warm ahead of the rest.
    ranked = sorted(sorted(ready, key=created, reverse=True), key=not_warm)
    warm = {p["metadata"]["name"] for p in ranked[:warm_count]}
    return {
        p["metadata"]["name"]: "warm" if p["metadata"]["name"] in warm else "active" for p in ready
    }
