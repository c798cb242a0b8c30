"""An approximate map of which replica holds which prompt prefix, bounded like a KV cache.

One global dict maps a block hash to a bitmask of replicas that (probably) hold it, so the
longest match on every replica is found in one walk over the prompt's blocks, not one per
replica. Each replica's blocks sit in an LRU bounded by its KV capacity (in blocks). A
prompt's blocks are touched last-to-first, so a prefix's head is always fresher than its
tail and eviction trims prefixes from the end, as a radix cache does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_CAPACITY_BLOCKS = 400_000 // 32  # ~400k tokens (an 8B model on an 80 GB GPU)


def leading_matches(
    holders: dict[int, int], blocks: Sequence[int], slots: Sequence[int]
) -> list[int]:
    """For each slot, how many leading `blocks` its bit is set on in `holders` (block →
    bitmask of slots): one walk over the blocks for all slots, stopping when none is left."""
    want = 0
    for s in slots:
        want |= 1 << s
    depth: dict[int, int] = {}
    alive = want
    for i, h in enumerate(blocks):
        have = holders.get(h, 0) & alive
        if have != alive:
            lost = alive & ~have
            while lost:  # each slot that stops matching here
                low = lost & -lost
                depth[low.bit_length() - 1] = i
                lost ^= low
            alive = have
            if not alive:
                break
    return [depth.get(s, len(blocks)) for s in slots]


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        """block hash → bitmask of replica slots."""
        self._lru: dict[int, OrderedDict[int, None]] = {}
        self._capacity: dict[int, int] = {}
        self._slots: dict[str, int] = {}
        self._free_slots: list[int] = []

    def slot(self, key: str) -> int:
        if key not in self._slots:
            slot = self._free_slots.pop() if self._free_slots else len(self._slots)
            self._slots[key] = slot
            self._lru[slot] = OrderedDict()
            self._capacity[slot] = DEFAULT_CAPACITY_BLOCKS
        return self._slots[key]

    def set_capacity(self, key: str, blocks: int) -> None:
        slot = self.slot(key)
        blocks = max(1, blocks)
        if self._capacity[slot] != blocks:
            self._capacity[slot] = blocks
            self._trim(slot)

    def entries(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    def match(self, blocks: Sequence[int], keys: Sequence[str]) -> list[int]:
        """Matched leading blocks for each of `keys` (same order)."""
        known = self._slots
        slots = [known[k] if k in known else self.slot(k) for k in keys]
        return leading_matches(self._holders, blocks, slots)

    def insert(self, key: str, blocks: Sequence[int]) -> None:
        """`key` now holds these blocks (after a request's prefill runs there)."""
        slot = self.slot(key)
        lru = self._lru[slot]
        bit = 1 << slot
        holders = self._holders
        for h in reversed(blocks):  # head last = most recent: prefixes evict tail-first
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders[h] = holders.get(h, 0) | bit
        self._trim(slot)

    def _trim(self, slot: int) -> None:
        lru, cap, bit = self._lru[slot], self._capacity[slot], 1 << slot
        holders = self._holders
        while len(lru) > cap:
            h, _ = lru.popitem(last=False)
            mask = holders.get(h, 0) & ~bit
            if mask:
                holders[h] = mask
            else:
                holders.pop(h, None)

    def remove(self, key: str) -> None:
        slot = self._slots.pop(key, None)
        if slot is None:
            return
        bit = 1 << slot
        for h in self._lru.pop(slot):
            mask = self._holders.get(h, 0) & ~bit
            if mask:
                self._holders[h] = mask
            else:
                self._holders.pop(h, None)
        self._capacity.pop(slot, None)
        self._free_slots.append(slot)
