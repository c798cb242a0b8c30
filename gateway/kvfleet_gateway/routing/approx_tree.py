"""sglang-router's approximate radix tree: which worker most recently saw which prefix.

A radix tree over the request text (or token ids: any sliceable sequence), where each node
remembers the workers ("tenants") whose requests passed through it and when. No engine is
asked anything: the tree only records where this router sent what.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any


class _Node:
    __slots__ = ("children", "edge", "parent", "tenants")

    def __init__(self, edge: Any, parent: _Node | None) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[Any, _Node] = {}
        self.tenants: dict[str, int] = {}
        """tenant → last access tick."""


def _common(a: Sequence[Any], start: int, b: Sequence[Any]) -> int:
    n = min(len(b), len(a) - start)
    lo, hi = 0, n
    while lo < hi:  # binary search on C-speed slice comparisons
        mid = (lo + hi + 1) // 2
        if a[start : start + mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ApproxTree:
    def __init__(self) -> None:
        self.root = _Node(None, None)
        self.sizes: dict[str, int] = {}
        """Units (characters or tokens) each tenant holds in the tree."""
        self._tick = itertools.count(1)

    def add_tenant(self, tenant: str) -> None:
        self.sizes.setdefault(tenant, 0)
        self.root.tenants[tenant] = next(self._tick)

    def remove_tenant(self, tenant: str) -> None:
        self.sizes.pop(tenant, None)
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.tenants.pop(tenant, None)
            stack.extend(node.children.values())

    def prefix_match(self, text: Sequence[Any]) -> tuple[int, str | None]:
        """Length of the longest recorded prefix, and its most recent tenant."""
        node, pos = self.root, 0
        best: _Node = self.root
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            m = _common(text, pos, child.edge)
            pos += m
            if child.tenants:
                best = child
            if m < len(child.edge):
                break
            node = child
        tenant = max(best.tenants, key=lambda t: best.tenants[t]) if best.tenants else None
        matched = pos if best is not self.root else 0
        return matched, tenant

    def insert(self, text: Sequence[Any], tenant: str) -> None:
        tick = next(self._tick)
        self.sizes.setdefault(tenant, 0)
        node, pos = self.root, 0
        node.tenants[tenant] = tick
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                leaf = _Node(text[pos:], node)
                leaf.tenants[tenant] = tick
                node.children[text[pos]] = leaf
                self.sizes[tenant] += len(text) - pos
                return
            m = _common(text, pos, child.edge)
            if m < len(child.edge):  # split the edge at the divergence
                upper = _Node(child.edge[:m], node)
                upper.tenants = dict(child.tenants)
                child.edge = child.edge[m:]
                child.parent = upper
                upper.children[child.edge[0]] = child
                node.children[text[pos]] = upper
                child = upper
            if tenant not in child.tenants:
                self.sizes[tenant] += len(child.edge)
            child.tenants[tenant] = tick
            pos += m
            node = child
