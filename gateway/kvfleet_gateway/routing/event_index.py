"""An exact map of which replica holds which prompt page, kept from the engines' KV events.

Where `prefix_index.PrefixIndex` guesses from routing history (and goes on believing in
prefixes an engine has already evicted), this index holds exactly what each engine's radix
cache reported: a page hash is set for a replica on `BlockStored`, cleared on `BlockRemoved`,
and everything of a replica goes on `AllBlocksCleared` or when its event stream drops.

Events lag a placement by the prefill, so the pages of requests this gateway has sent but
whose first token has not come back count as held too (`reserve` / `release`): a burst of
requests for one new prefix then follows its first request instead of spreading.

Memory: one dict entry per distinct page hash held anywhere (the holders' bitmask is its
value), about 100 bytes; a page held by several replicas costs no more.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def held_prefixes(
    holders: dict[int, int], inflight: dict[int, int], pages: Sequence[int], slots: Sequence[int]
) -> list[int]:
    """For each slot, how many leading `pages` it holds (or is prefilling).

    A radix cache holds prefixes: a page is evicted only after every page that extends it,
    and a page's hash names its whole prefix, so the set of replicas holding page i only
    shrinks as i grows. Each replica's match length is where it drops out, found by
    bisection: O(log n) lookups per distinct length instead of one per page (a 2,048-token
    prompt at 16 tokens per page is 128 pages, and most replicas drop out together).
    """
    want = 0
    for s in slots:
        want |= 1 << s
    depth: dict[int, int] = {}
    get_h, get_i = holders.get, inflight.get

    def at(i: int) -> int:
        h = pages[i]
        return (get_h(h, 0) | get_i(h, 0)) & want

    # Segments (lo, hi, mask at lo, mask at hi), with mask(-1) = want and mask(n) = 0.
    stack = [(-1, len(pages), want, 0)]
    while stack:
        lo, hi, m_lo, m_hi = stack.pop()
        if m_lo == m_hi:
            continue  # nobody drops out in (lo, hi]
        if hi - lo == 1:
            lost = m_lo & ~m_hi
            while lost:  # these hold page lo but not page hi: `hi` leading pages
                low = lost & -lost
                depth[low.bit_length() - 1] = hi
                lost ^= low
            continue
        mid = (lo + hi) // 2
        m_mid = at(mid)
        stack.append((mid, hi, m_mid, m_hi))
        stack.append((lo, mid, m_lo, m_mid))
    return [depth.get(s, 0) for s in slots]


class EventIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        """page hash → bitmask of replica slots whose engine reported it stored."""
        self._inflight: dict[int, int] = {}
        """page hash → bitmask of slots this gateway sent it to, prefill not yet done."""
        self._inflight_refs: dict[tuple[int, int], int] = {}
        self._slots: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._live: dict[str, int] = {}
        """Replicas whose stream is synchronised → their block size (tokens per page)."""
        self._held: dict[int, int] = {}
        """slot → pages held (for metrics and the memory statement)."""

    def _slot(self, key: str) -> int:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slots)
            self._slots[key] = slot
            self._held[slot] = 0
        return slot

    # ---- the stream's side -------------------------------------------------------------

    def set_live(self, key: str, block_size: int) -> None:
        """`key`'s stream is synchronised: its pages here are what its engine holds."""
        self._slot(key)
        self._live[key] = block_size

    def set_down(self, key: str) -> None:
        """`key`'s stream dropped: forget its pages (the approximate index stands in)."""
        self._live.pop(key, None)
        self.cleared(key)

    def is_live(self, key: str) -> bool:
        return key in self._live

    def stored(self, key: str, hashes: Iterable[int]) -> None:
        slot = self._slot(key)
        bit, holders, added = 1 << slot, self._holders, 0
        for h in hashes:
            mask = holders.get(h, 0)
            if not mask & bit:
                holders[h] = mask | bit
                added += 1
        self._held[slot] += added

    def removed(self, key: str, hashes: Iterable[int]) -> None:
        slot = self._slots.get(key)
        if slot is None:
            return
        bit, holders, gone = 1 << slot, self._holders, 0
        for h in hashes:
            mask = holders.get(h, 0)
            if mask & bit:
                gone += 1
                if mask == bit:
                    del holders[h]
                else:
                    holders[h] = mask & ~bit
        self._held[slot] -= gone

    def cleared(self, key: str) -> None:
        """Every page of `key` is gone (a scan of the whole index: rare, and O(pages))."""
        slot = self._slots.get(key)
        if slot is None or not self._held[slot]:
            return
        bit = 1 << slot
        holders = self._holders
        for h in [h for h, mask in holders.items() if mask & bit]:
            mask = holders[h] & ~bit
            if mask:
                holders[h] = mask
            else:
                del holders[h]
        self._held[slot] = 0

    def remove(self, key: str) -> None:
        """The replica left the fleet."""
        self.set_down(key)
        slot = self._slots.pop(key, None)
        if slot is not None:
            for h, s in [k for k in self._inflight_refs if k[1] == slot]:
                self._drop_inflight(h, s, self._inflight_refs.pop((h, s)))
            self._held.pop(slot, None)
            self._free_slots.append(slot)

    # ---- the router's side -------------------------------------------------------------

    def match(self, pages: Sequence[int], block_size: int, keys: Sequence[str]) -> list[int | None]:
        """Leading pages of `pages` each of `keys` holds (or is prefilling for this gateway);
        None for a replica whose stream is not live or hashes pages of another size."""
        live = self._live
        slots = [self._slot(k) for k in keys]
        found = held_prefixes(self._holders, self._inflight, pages, slots)
        return [n if live.get(k) == block_size else None for k, n in zip(keys, found, strict=True)]

    def reserve(self, key: str, pages: Sequence[int]) -> None:
        """A request with these pages was sent to `key`: count them held until `release`."""
        slot = self._slot(key)
        bit, refs, inflight = 1 << slot, self._inflight_refs, self._inflight
        for h in pages:
            n = refs.get((h, slot), 0)
            refs[(h, slot)] = n + 1
            if not n:
                inflight[h] = inflight.get(h, 0) | bit

    def release(self, key: str, pages: Sequence[int]) -> None:
        slot = self._slots.get(key)
        if slot is None:
            return
        for h in pages:
            self._drop_inflight(h, slot, 1)

    def _drop_inflight(self, h: int, slot: int, count: int) -> None:
        refs = self._inflight_refs
        n = refs.get((h, slot), 0) - count
        if n > 0:
            refs[(h, slot)] = n
            return
        refs.pop((h, slot), None)
        mask = self._inflight.get(h, 0) & ~(1 << slot)
        if mask:
            self._inflight[h] = mask
        else:
            self._inflight.pop(h, None)

    # ---- what it knows -----------------------------------------------------------------

    def pages_held(self, key: str) -> int:
        slot = self._slots.get(key)
        return self._held.get(slot, 0) if slot is not None else 0

    def distinct_pages(self) -> int:
        return len(self._holders)

    def live_keys(self) -> list[str]:
        return list(self._live)

    def block_size(self) -> int | None:
        """The page size prompts are hashed at: the live streams' (one per service, as every
        replica runs the same engine arguments; the most common if they differ)."""
        sizes = list(self._live.values())
        return max(set(sizes), key=sizes.count) if sizes else None
