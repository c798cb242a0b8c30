"""A token-level radix prefix cache, as SGLang's RadixCache behaves.

Edges hold runs of token ids; a node is "locked" while running requests use it (lock_ref
counts down the path to the root), and only unlocked leaves are evicted, least recently used
first. Sizes are kept incrementally so the scheduler can ask for `evictable_size` in O(1).

Eviction candidates sit in a lazy heap: an entry is checked when popped (still a leaf, still
unlocked, same access stamp) rather than re-heaped on every access.

With a `CacheEventSink` attached (`--kv-events-config`), every node that enters the tree and
every node evicted from it is reported, with the chained per-page digests SGLang names pages
by (`kv_events.py`); a node keeps its pages' digests so eviction and splits need no rehash.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count
from typing import Protocol


class CacheEventSink(Protocol):
    """Told what enters and leaves the tree (SGLang's KV-event recorder does the same)."""

    def digests(self, prior: bytes | None, tokens: Sequence[int]) -> list[bytes]:
        """Chained digests of the whole pages of `tokens`, following `prior`."""
        ...

    def namespace_seed(self, salt: str) -> bytes:
        """The digest a salted namespace's first page chains from (SGLang's)."""
        ...

    def stored(
        self, parent: bytes | None, digests: list[bytes], tokens: Sequence[int], salt: str | None
    ) -> None: ...

    def removed(self, digests: list[bytes]) -> None: ...

    def cleared(self) -> None: ...


class Node:
    __slots__ = ("children", "digests", "key", "last_access", "lock_ref", "parent")

    def __init__(self, key: list[int], parent: Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int | tuple[int, ...], Node] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.digests: list[bytes] = []
        """Per-page digests, kept only when a CacheEventSink is attached."""


@dataclass(frozen=True, slots=True)
class Match:
    length: int
    node: Node


def _common_prefix(key: Sequence[int], pos: int, edge: list[int]) -> int:
    """Length of the common prefix of key[pos:] and edge, by binary search on C-speed slices."""
    lo, hi = 0, min(len(edge), len(key) - pos)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if key[pos : pos + mid] == edge[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixCache:
    """Prefix cache over token ids. Tokens it holds occupy KV pool slots."""

    def __init__(self, page_size: int = 1) -> None:
        self.page_size = page_size
        self._tick = count(1)
        self._seq = count()
        self.events: CacheEventSink | None = None
        self.total_size = 0
        self.reset()

    def reset(self) -> None:
        if self.events is not None and self.total_size:
            self.events.cleared()
        self.root = Node([], None)
        self.root.lock_ref = 1  # the root is never evicted
        self._salted: dict[str, Node] = {}
        """A root per cache salt (SGLang's `cache_salt`): a salted prompt reuses only the
        prefixes cached under its own salt."""
        self.total_size = 0
        self.evictable_size = 0
        self._heap: list[tuple[int, int, Node]] = []

    @property
    def protected_size(self) -> int:
        return self.total_size - self.evictable_size

    def _aligned(self, key: Sequence[int]) -> Sequence[int]:
        if self.page_size == 1:
            return key
        return key[: len(key) - len(key) % self.page_size]

    def _child_key(self, tokens: Sequence[int], pos: int = 0) -> int | tuple[int, ...]:
        """How a parent names a child: by the child's first page (SGLang's paged key). Keyed
        by the first token alone, two edges that share it but differ within the page would
        collide: the second replaced the first, whose tokens stayed counted in the pool."""
        if self.page_size == 1:
            return tokens[pos]
        return tuple(tokens[pos : pos + self.page_size])

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))

    def _split(self, child: Node, at: int) -> Node:
        """Cut child's edge at `at`; return the new upper node (which ends at the cut)."""
        parent = child.parent
        assert parent is not None
        upper = Node(child.key[:at], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        if child.digests:  # splits fall on page boundaries (_walk aligns them)
            pages = at // self.page_size
            upper.digests, child.digests = child.digests[:pages], child.digests[pages:]
        child.key = child.key[at:]
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        parent.children[self._child_key(upper.key)] = upper
        return upper

    def _root(self, salt: str | None, create: bool) -> Node | None:
        if salt is None:
            return self.root
        root = self._salted.get(salt)
        if root is None and create:
            root = self._salted[salt] = Node([], None)
            root.lock_ref = 1
        return root

    def _walk(
        self, key: Sequence[int], tick: int | None, salt: str | None = None
    ) -> tuple[Node, int, Node | None, int]:
        """Descend along whole edges of key (in `salt`'s namespace). Returns the deepest node
        reached, the tokens matched so far, and the child whose edge matched only partly (with
        the page-aligned length of that partial match), or None. `tick` stamps the path
        (LRU); None: read-only."""
        root = self._root(salt, create=tick is not None)
        if root is None:
            return self.root, 0, None, 0  # a salt never seen: nothing cached for it
        node, pos, n = root, 0, len(key)
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            edge = child.key
            if key[pos : pos + len(edge)] == edge:
                pos += len(edge)
                node = child
                if tick is not None:
                    node.last_access = tick
                continue
            m = _common_prefix(key, pos, edge)
            return node, pos, child, m - m % self.page_size
        return node, pos, None, 0

    def _descend(self, key: Sequence[int], tick: int, salt: str | None) -> tuple[Node, int]:
        """Walk key down the tree, splitting a partly matched edge so a node ends exactly
        where the match does (what match_prefix and insert both need)."""
        node, pos, partial, m = self._walk(key, tick, salt)
        if partial is not None and m > 0:
            node = self._split(partial, m)
            node.last_access = tick
            pos += m
        return node, pos

    def match_prefix(self, key: Sequence[int], salt: str | None = None) -> Match:
        """Longest cached prefix of key; touches the path (LRU) and splits at the boundary."""
        node, pos = self._descend(self._aligned(key), next(self._tick), salt)
        return Match(pos, node)

    def peek(self, key: Sequence[int], salt: str | None = None) -> int:
        """Cached prefix length of key, read-only: no split, no LRU touch (for observers)."""
        _, pos, _, m = self._walk(self._aligned(key), None, salt)
        return pos + m

    def insert(self, key: Sequence[int], salt: str | None = None) -> int:
        """Add key to the tree; return how many of its leading tokens were already cached."""
        key = self._aligned(key)
        tick = next(self._tick)
        node, pos = self._descend(key, tick, salt)
        matched, n = pos, len(key)
        if pos < n:
            leaf = Node(list(key[pos:]), node)
            leaf.last_access = tick
            node.children[self._child_key(key, pos)] = leaf
            if self.events is not None:
                at_root = node.parent is None
                prior = node.digests[-1] if node.digests else None
                if at_root and salt is not None:
                    prior = self.events.namespace_seed(salt)
                leaf.digests = self.events.digests(prior, leaf.key)
                # A page under a root links back to nothing, salted or not (as SGLang's).
                self.events.stored(None if at_root else prior, leaf.digests, leaf.key, salt)
            self.total_size += n - pos
            self.evictable_size += n - pos
            self._push(leaf)
        return matched

    def inc_lock_ref(self, node: Node) -> None:
        while node.parent is not None:  # up to its namespace's root
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: Node) -> None:
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                if not node.children:
                    self._push(node)
            assert node.parent is not None
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves, least recently used first, until num_tokens are freed."""
        freed = 0
        heap = self._heap
        while freed < num_tokens and heap:
            stamp, _, node = heapq.heappop(heap)
            if node.parent is None or node.children or node.lock_ref > 0:
                continue  # evicted already, no longer a leaf, or in use
            if stamp != node.last_access:
                self._push(node)  # touched since it was queued: requeue at its new age
                continue
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            node.parent = None
            if self.events is not None and node.digests:
                self.events.removed(node.digests)
            size = len(node.key)
            freed += size
            self.total_size -= size
            self.evictable_size -= size
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                self._push(parent)
        return freed


class DisabledCache(RadixCache):
    """`--disable-radix-cache`: nothing is ever shared; finished requests free their KV."""

    def match_prefix(self, key: Sequence[int], salt: str | None = None) -> Match:
        return Match(0, self.root)

    def insert(self, key: Sequence[int], salt: str | None = None) -> int:
        return len(key)  # "already cached" → the caller frees every token of the request

    def peek(self, key: Sequence[int], salt: str | None = None) -> int:
        return 0
