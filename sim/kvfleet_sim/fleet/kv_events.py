"""KV events in the fleet simulator: each simulated engine's radix cache reports what it
stores and evicts straight to every gateway's `EventIndex`, as each gateway's ZeroMQ
subscription does in production (minus the network's milliseconds). The pages are named by
SGLang's hash on both sides: the engine's digests here, the gateway's `page_hashes` for the
prompts it routes, so the index the policy reads is the one the gateway would hold.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet_gateway.routing.event_index import EventIndex
from kvfleet_sim.kv_events import event_hash, namespace_seed, page_digests


class FleetKvEvents:
    """A `radix.CacheEventSink` for one simulated engine."""

    def __init__(self, key: str, page_size: int, indexes: Sequence[EventIndex]) -> None:
        self.key, self.page_size, self.indexes = key, page_size, indexes
        for index in indexes:
            index.set_live(key, page_size)

    def digests(self, prior: bytes | None, tokens: Sequence[int]) -> list[bytes]:
        return page_digests(prior, tokens, self.page_size)

    def namespace_seed(self, salt: str) -> bytes:
        return namespace_seed(salt)

    def stored(
        self,
        parent: bytes | None,
        digests: list[bytes],
        tokens: Sequence[int],
        salt: str | None = None,
    ) -> None:
        hashes = [event_hash(d) for d in digests]
        for index in self.indexes:
            index.stored(self.key, hashes)

    def removed(self, digests: list[bytes]) -> None:
        hashes = [event_hash(d) for d in digests]
        for index in self.indexes:
            index.removed(self.key, hashes)

    def cleared(self) -> None:
        for index in self.indexes:
            index.cleared(self.key)
