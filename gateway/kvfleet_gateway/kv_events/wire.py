"""SGLang's KV-event wire format (sglang/srt/disaggregation/kv_events.py, 0.5.x), decoded.

A message is three ZeroMQ frames: topic, sequence number (8 bytes, big-endian) and a msgpack
`EventBatch`, a positional array `[ts, events, attn_dp_rank]`. Each event is a msgpack map
tagged by `type` (the class name); optional fields left at their default are omitted. The
replay socket answers a request for "everything from sequence n" with the same frames and
ends with an empty topic, sequence -1 and an empty payload.

Fields this consumer does not use still get defaults, so an engine that adds or omits an
optional field does not break decoding.
"""

from __future__ import annotations

from typing import Any

import msgspec

END_SEQ = -1


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[Any] = msgspec.field(default_factory=list)
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KvEvent]
    attn_dp_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EventBatch)


def decode_batch(payload: bytes) -> EventBatch:
    """The batch in a message's third frame (msgspec.DecodeError on anything else)."""
    return _decoder.decode(payload)


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)
