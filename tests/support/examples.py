"""The examples as a test on a shared cluster applies them: each document moved into the
test's own namespace (the examples are written for `ai`), then `kubectl apply`."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from tests.support.kubectl import kubectl
from tests.support.objects import EXAMPLES, example


def example_docs(name: str) -> list[dict[str, Any]]:
    """The documents of `examples/<name>`: a file, or a folder's YAML files in the order
    `kubectl apply -f <folder>` takes them (by name)."""
    path = EXAMPLES / name
    if path.is_dir():
        return [d for f in sorted(path.glob("*.yaml")) for d in example(f"{name}/{f.name}")]
    return example(name)


def in_namespace(docs: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """The documents with `metadata.namespace` set to `namespace`. The Namespace an example
    creates is left out: the test's namespace stands in for it."""
    out = []
    for doc in docs:
        if doc["kind"] == "Namespace":
            continue
        doc = copy.deepcopy(doc)
        doc["metadata"]["namespace"] = namespace
        out.append(doc)
    return out


async def apply_example(kubeconfig: Path, namespace: str, *names: str) -> str:
    """`kubectl apply -f examples/<name>` for each name in turn, in `namespace`; kubectl's
    output."""
    out = ""
    for name in names:
        docs = in_namespace(example_docs(name), namespace)
        out += await kubectl(kubeconfig, "apply", "-f", "-", stdin=yaml.safe_dump_all(docs))
    return out
