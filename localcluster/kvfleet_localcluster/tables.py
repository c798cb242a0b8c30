"""Server-side printing: `kubectl get` asks for a `meta.k8s.io/v1` Table and prints its
columns. Custom resources get their CRD's additionalPrinterColumns (JSONPath), pods and
Deployments the columns a real API server gives them, anything else NAME and AGE."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

Json = dict[str, Any]
_FILTER = re.compile(r'^(\w+)\[\?\(@\.(\w+)==["\']([^"\']*)["\']\)\]$')


def jsonpath(obj: Any, path: str) -> Any:
    """The JSONPath subset printer columns use: `.a.b`, `.a[0]`, `.a[?(@.k=="v")].b`."""
    node = obj
    for part in [p for p in re.split(r"\.(?![^\[]*\])", path.strip().lstrip(".")) if p]:
        if node is None:
            return None
        m = _FILTER.match(part)
        if m:
            items = node.get(m.group(1)) if isinstance(node, dict) else None
            node = next((i for i in items or [] if str(i.get(m.group(2))) == m.group(3)), None)
            continue
        index = re.match(r"^(\w+)\[(\d+)\]$", part)
        if index:
            items = node.get(index.group(1)) if isinstance(node, dict) else None
            n = int(index.group(2))
            node = items[n] if isinstance(items, list) and n < len(items) else None
            continue
        node = node.get(part) if isinstance(node, dict) else None
    return node


def age(timestamp: str | None, now: datetime | None = None) -> str:
    if not timestamp:
        return "<unknown>"
    then = datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    s = int(((now or datetime.now(UTC)) - then).total_seconds())
    if s < 120:
        return f"{max(s, 0)}s"
    if s < 3600 * 3:
        return f"{s // 60}m" if s < 600 or s % 60 == 0 else f"{s // 60}m{s % 60}s"
    if s < 86400 * 2:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _column(name: str, type_: str = "string", priority: int = 0, description: str = "") -> Json:
    return {
        "name": name,
        "type": type_,
        "format": "name" if name == "Name" else "",
        "description": description,
        "priority": priority,
    }


def _pod_cells(p: Json) -> list[Any]:
    status = p.get("status") or {}
    containers = (p.get("spec") or {}).get("containers") or []
    cstatus = status.get("containerStatuses") or []
    ready = sum(1 for c in cstatus if c.get("ready"))
    reason = status.get("phase") or "Pending"
    for c in cstatus:
        waiting = (c.get("state") or {}).get("waiting")
        if waiting:
            reason = waiting.get("reason") or reason
    if p["metadata"].get("deletionTimestamp"):
        reason = "Terminating"
    restarts = sum(int(c.get("restartCount") or 0) for c in cstatus)
    return [
        p["metadata"]["name"],
        f"{ready}/{len(containers)}",
        reason,
        restarts,
        age(p["metadata"].get("creationTimestamp")),
        status.get("podIP") or "<none>",
        "kvfleet-local" if status.get("podIP") else "<none>",
    ]


def _deployment_cells(d: Json) -> list[Any]:
    spec, status = d.get("spec") or {}, d.get("status") or {}
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or []
    selector = ",".join(
        f"{k}={v}" for k, v in ((spec.get("selector") or {}).get("matchLabels") or {}).items()
    )
    return [
        d["metadata"]["name"],
        f"{status.get('readyReplicas', 0)}/{spec.get('replicas', 1)}",
        status.get("updatedReplicas", 0),
        status.get("availableReplicas", 0),
        age(d["metadata"].get("creationTimestamp")),
        ",".join(c.get("name", "") for c in containers),
        ",".join(c.get("image", "") for c in containers),
        selector,
    ]


def _event_cells(e: Json) -> list[Any]:
    obj = e.get("involvedObject") or {}
    last = e.get("lastTimestamp") or e["metadata"].get("creationTimestamp")
    return [
        e["metadata"]["name"],
        age(last),
        e.get("type", ""),
        e.get("reason", ""),
        f"{(obj.get('kind') or '').lower()}/{obj.get('name', '')}",
        e.get("message", ""),
    ]


BUILTIN_COLUMNS: dict[str, tuple[list[Json], Callable[[Json], list[Any]]]] = {
    "Pod": (
        [
            _column("Name"),
            _column("Ready"),
            _column("Status"),
            _column("Restarts", "integer"),
            _column("Age"),
            _column("IP", priority=1),
            _column("Node", priority=1),
        ],
        _pod_cells,
    ),
    "Event": (
        [
            _column("Name", priority=1),
            _column("Last Seen"),
            _column("Type"),
            _column("Reason"),
            _column("Object"),
            _column("Message"),
        ],
        _event_cells,
    ),
    "Deployment": (
        [
            _column("Name"),
            _column("Ready"),
            _column("Up-to-date", "integer"),
            _column("Available", "integer"),
            _column("Age"),
            _column("Containers", priority=1),
            _column("Images", priority=1),
            _column("Selector", priority=1),
        ],
        _deployment_cells,
    ),
}


def _name_age(o: Json) -> list[Any]:
    return [o["metadata"]["name"], age(o["metadata"].get("creationTimestamp"))]


def _printer(printer_columns: list[Json]) -> tuple[list[Json], Callable[[Json], list[Any]]]:
    columns = [_column("Name")] + [
        _column(
            c["name"],
            "string" if c.get("type") == "date" else c.get("type", "string"),
            int(c.get("priority", 0)),
            c.get("description", ""),
        )
        for c in printer_columns
    ]

    def cells(o: Json) -> list[Any]:
        out: list[Any] = [o["metadata"]["name"]]
        for c in printer_columns:
            value = jsonpath(o, c["jsonPath"])
            out.append(age(value) if c.get("type") == "date" else value)
        return out

    return columns, cells


def to_table(kind: str, items: list[Json], printer_columns: list[Json] | None, rv: str) -> Json:
    """A Table of `items`; `printer_columns` are a CRD version's additionalPrinterColumns."""
    if printer_columns:
        columns, cells = _printer(printer_columns)
    elif kind in BUILTIN_COLUMNS:
        columns, cells = BUILTIN_COLUMNS[kind]
    else:
        columns, cells = [_column("Name"), _column("Age")], _name_age
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": rv},
        "columnDefinitions": columns,
        "rows": [
            {
                "cells": cells(o),
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": o["metadata"],
                },
            }
            for o in items
        ],
    }
