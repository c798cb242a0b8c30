"""Patch formats and selectors, as the Kubernetes API server applies them. Pure functions.

* JSON merge patch (RFC 7386): maps merge, `null` deletes, everything else replaces.
* JSON patch (RFC 6902): add / remove / replace / move / copy / test; a failed test is 422.
* Strategic merge patch: a merge patch whose lists of named things (containers, env,
  volumes, ...) merge element by element on their merge key, with `$patch: delete`.
* Label selectors (`a=b`, `a!=b`, `a in (x,y)`, `a notin (x)`, `a`, `!a`) and field selectors
  (`metadata.name=x`, `status.phase!=Running`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any


class PatchError(ValueError):
    """The patch cannot apply (422 Unprocessable Entity)."""


# The lists the built-in kinds we use merge by key (k8s.io/api struct tags: patchMergeKey).
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "conditions": "type",
    "tolerations": "key",
    "ownerReferences": "uid",
}


def _merge(target: Any, patch: Any, strategic: bool) -> Any:
    """RFC 7386 merge; `strategic` adds the keyed merge of named lists (MERGE_KEYS)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif (
            strategic
            and isinstance(value, list)
            and key in MERGE_KEYS
            and isinstance(result.get(key), list)
        ):
            result[key] = _merge_list(result[key], value, MERGE_KEYS[key])
        else:
            result[key] = _merge(result.get(key), value, strategic)
    return result


def merge_patch(target: Any, patch: Any) -> Any:
    return _merge(target, patch, strategic=False)


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    return _merge(target, patch, strategic=True)


def _merge_list(current: list[Any], patch: list[Any], key: str) -> list[Any]:
    merged = [copy.deepcopy(x) for x in current]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            merged.append(copy.deepcopy(item))
            continue
        at = next(
            (i for i, x in enumerate(merged) if isinstance(x, dict) and x.get(key) == item[key]),
            None,
        )
        if item.get("$patch") == "delete":
            if at is not None:
                merged.pop(at)
        elif at is None:
            merged.append(copy.deepcopy(item))
        else:
            merged[at] = strategic_merge_patch(merged[at], item)
    return merged


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], create: bool = False) -> tuple[Any, str]:
    node = doc
    for part in parts[:-1]:
        if isinstance(node, list):
            node = node[int(part)]
        elif isinstance(node, dict):
            if part not in node:
                raise PatchError(f"path segment {part!r} does not exist")
            node = node[part]
        else:
            raise PatchError(f"cannot descend into {type(node).__name__}")
    return node, parts[-1]


def _get(doc: Any, path: str) -> Any:
    node = doc
    for part in _pointer(path):
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise PatchError(f"path {path!r} does not exist") from None
    return node


def _add(doc: Any, path: str, value: Any) -> Any:
    parts = _pointer(path)
    if not parts:
        return copy.deepcopy(value)
    parent, last = _parent(doc, parts)
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if not 0 <= index <= len(parent):
            raise PatchError(f"index {index} out of range at {path!r}")
        parent.insert(index, copy.deepcopy(value))
    elif isinstance(parent, dict):
        parent[last] = copy.deepcopy(value)
    else:
        raise PatchError(f"cannot add at {path!r}")
    return doc


def _remove(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    parent, last = _parent(doc, parts)
    try:
        if isinstance(parent, list):
            parent.pop(int(last))
        else:
            del parent[last]
    except (KeyError, IndexError, ValueError, TypeError):
        raise PatchError(f"path {path!r} does not exist") from None
    return doc


def json_patch(target: Any, ops: Any) -> Any:
    if not isinstance(ops, list):
        raise PatchError("a JSON patch is a list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"malformed operation {op!r}")
        kind, path = op["op"], op["path"]
        if kind == "test":
            if _get(doc, path) != op.get("value"):
                raise PatchError(f"test failed at {path!r}")
        elif kind == "add":
            doc = _add(doc, path, op.get("value"))
        elif kind == "remove":
            doc = _remove(doc, path)
        elif kind == "replace":
            _get(doc, path)
            doc = _add(_remove(doc, path), path, op.get("value"))
        elif kind in ("move", "copy"):
            value = _get(doc, op.get("from", ""))
            if kind == "move":
                doc = _remove(doc, op["from"])
            doc = _add(doc, path, value)
        else:
            raise PatchError(f"unknown op {kind!r}")
    return doc


# ---- selectors ---------------------------------------------------------------------------

_SET = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_terms(selector: str) -> list[str]:
    terms, depth, cur = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
        else:
            cur += ch
    terms.append(cur)
    return [t.strip() for t in terms if t.strip()]


Labels = dict[str, str]
LabelCheck = Callable[[Labels], bool]


def _equals(key: str, value: str, negate: bool) -> LabelCheck:
    return lambda labels: (labels.get(key) == value) != negate


def _member(key: str, values: set[str], negate: bool) -> LabelCheck:
    return lambda labels: (labels.get(key) in values) != negate


def _exists(key: str, negate: bool) -> LabelCheck:
    return lambda labels: (key in labels) != negate


def label_matcher(selector: str | None) -> LabelCheck:
    """A predicate over a labels dict; raises ValueError on a malformed selector."""
    if not selector:
        return lambda labels: True
    checks: list[LabelCheck] = []
    for term in _split_terms(selector):
        if m := _SET.match(term):
            values = {v.strip() for v in m.group(3).split(",")}
            checks.append(_member(m.group(1), values, m.group(2) == "notin"))
        elif "!=" in term:
            key, value = (x.strip() for x in term.split("!=", 1))
            checks.append(_equals(key, value, True))
        elif "=" in term:
            key, value = (x.strip() for x in term.replace("==", "=").split("=", 1))
            checks.append(_equals(key, value, False))
        elif term.startswith("!"):
            checks.append(_exists(term[1:].strip(), True))
        elif re.fullmatch(r"[\w./-]+", term):
            checks.append(_exists(term, False))
        else:
            raise ValueError(f"unable to parse requirement {term!r}")
    return lambda labels: all(c(labels) for c in checks)


def equality_terms(selector: str | None) -> list[tuple[str, str]]:
    """The `key=value` terms of a label selector (what an index can answer)."""
    out = []
    for term in _split_terms(selector or ""):
        if "!=" not in term and "=" in term and not _SET.match(term):
            key, value = (x.strip() for x in term.replace("==", "=").split("=", 1))
            out.append((key, value))
    return out


def _field(path: str, value: str, negate: bool) -> Callable[[dict[str, Any]], bool]:
    def check(obj: dict[str, Any]) -> bool:
        node: Any = obj
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return (("" if node is None else str(node)) == value) != negate

    return check


def field_matcher(selector: str | None) -> Callable[[dict[str, Any]], bool]:
    if not selector:
        return lambda obj: True
    checks = []
    for term in _split_terms(selector):
        negate = "!=" in term
        path, value = (x.strip() for x in term.replace("==", "=").replace("!=", "=").split("=", 1))
        checks.append(_field(path, value, negate))
    return lambda obj: all(c(obj) for c in checks)
