"""Radix cache: prefix matching, lock refs, LRU eviction of unlocked leaves, exact sizes."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_sim.radix import DisabledCache, RadixCache


def test_insert_then_match_shares_prefixes_and_splits_edges() -> None:
    c = RadixCache()
    assert c.insert([1, 2, 3, 4]) == 0
    assert c.insert([1, 2, 9]) == 2
    assert c.total_size == 5
    assert c.match_prefix([1, 2, 3, 4, 5]).length == 4
    assert c.match_prefix([1, 2, 7]).length == 2
    assert c.match_prefix([8]).length == 0


def test_locked_nodes_are_not_evictable() -> None:
    c = RadixCache()
    c.insert([1, 2, 3])
    c.insert([5, 6])
    m = c.match_prefix([1, 2, 3])
    c.inc_lock_ref(m.node)
    assert c.evictable_size == 2
    assert c.protected_size == 3
    assert c.evict(100) == 2
    assert c.total_size == 3
    c.dec_lock_ref(m.node)
    assert c.evictable_size == 3
    assert c.evict(100) == 3
    assert c.total_size == 0


def test_eviction_is_least_recently_used_first() -> None:
    c = RadixCache()
    c.insert([1, 1])
    c.insert([2, 2])
    c.insert([3, 3])
    c.match_prefix([1, 1])  # touch: now the most recent
    assert c.evict(2) == 2
    assert c.match_prefix([2, 2]).length == 0
    assert c.match_prefix([1, 1]).length == 2
    assert c.match_prefix([3, 3]).length == 2


def test_evicting_a_leaf_exposes_its_parent() -> None:
    c = RadixCache()
    c.insert([1, 2, 3])
    c.insert([1, 2, 4])  # [1,2] becomes an inner node with two leaves
    assert c.evict(5) == 4
    assert c.total_size == 0


def test_page_size_aligns_matches() -> None:
    c = RadixCache(page_size=4)
    c.insert(list(range(10)))  # only 8 tokens (two pages) are kept
    assert c.total_size == 8
    assert c.match_prefix([*list(range(7)), 99]).length == 4


def test_disabled_cache_keeps_nothing() -> None:
    c = DisabledCache()
    assert c.insert([1, 2, 3]) == 3
    assert c.match_prefix([1, 2, 3]).length == 0
    assert c.total_size == 0


def _size(node) -> int:  # type: ignore[no-untyped-def]
    return sum(len(ch.key) + _size(ch) for ch in node.children.values())


def _unlocked(node) -> int:  # type: ignore[no-untyped-def]
    return sum(
        (len(ch.key) if ch.lock_ref == 0 else 0) + _unlocked(ch) for ch in node.children.values()
    )


ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "lock", "unlock", "evict"]),
        st.lists(st.integers(0, 3), min_size=1, max_size=12),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_sizes_always_match_the_tree(script: list[tuple[str, list[int]]]) -> None:
    c = RadixCache()
    locked = []
    for op, key in script:
        if op == "insert":
            c.insert(key)
        elif op == "lock":
            m = c.match_prefix(key)
            c.inc_lock_ref(m.node)
            locked.append(m.node)
        elif op == "unlock" and locked:
            c.dec_lock_ref(locked.pop(0))
        elif op == "evict":
            before = c.total_size
            freed = c.evict(len(key))
            assert c.total_size == before - freed
        assert c.total_size == _size(c.root)
        assert c.evictable_size == _unlocked(c.root)
        # a locked path is never evicted
        for node in locked:
            n = node
            while n is not c.root:
                assert n.parent is not None
                n = n.parent
