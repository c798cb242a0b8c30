"""SGLang's KV-cache events, published by the simulated engine (`--kv-events-config`).

What SGLang 0.5.x sends, byte for byte (sglang/srt/disaggregation/kv_events.py and
sglang/srt/mem_cache/events.py): a ZeroMQ PUB socket sends three frames per batch — topic,
sequence number (8 bytes, big-endian, from 0) and a msgpack `EventBatch`, the array
`[ts, events, attn_dp_rank]` — where each event is a map tagged by `type`:
`BlockStored` (block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium),
`BlockRemoved` (block_hashes, medium) or `AllBlocksCleared`; optional fields left unset are
omitted. A ROUTER socket on the replay endpoint answers a request for "from sequence n"
with every buffered batch from n, then an empty topic, sequence -1 and an empty payload.

Pages are named as SGLang's native hash names them: SHA-256 over the previous page's digest
and the page's token ids as little-endian uint32; the event carries the digest's first 8
bytes as a signed int64.

The engine loop calls `flush()` after each step, so a batch holds one step's events, as
SGLang's scheduler publishes them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

log = logging.getLogger("kvfleet.sim.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KvEventsConfig:
    """`--kv-events-config`, the JSON object SGLang's KVEventsConfig reads."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None
    """Bind (True) or connect the PUB socket; None: bind a wildcard host, ipc or inproc."""
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def from_cli(cls, value: str) -> KvEventsConfig:
        try:
            raw = json.loads(value)
        except ValueError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        config = cls(**known)
        if config.publisher not in ("null", "zmq"):
            raise ValueError(f"unknown event publisher {config.publisher!r}")
        return config

    def binds(self) -> bool:
        if self.bind is not None:
            return self.bind
        e = self.endpoint
        return any(w in e for w in ("*", "::", "0.0.0.0")) or e.startswith(("ipc://", "inproc://"))

    def port(self, endpoint: str | None) -> int | None:
        if endpoint is None or not endpoint.startswith("tcp://"):
            return None
        return int(endpoint.rsplit(":", 1)[1])

    def describe(self, block_size: int) -> dict[str, Any] | None:
        """The `kv_events` block of /server_info (SGLang's describe_kv_events_publisher)."""
        port = self.port(self.endpoint)
        if self.publisher != "zmq" or port is None:
            return None
        host = self.endpoint[len("tcp://") :].rsplit(":", 1)[0]
        block: dict[str, Any] = {
            "publisher": "zmq",
            "endpoint_host": host,
            "endpoint_port_base": port,
            "topic": self.topic,
            "block_size": block_size,
            "dp_size": 1,
        }
        replay = self.port(self.replay_endpoint)
        if replay is not None:
            block["replay_endpoint_port_base"] = replay
        return block


def page_digests(prior: bytes | None, tokens: Sequence[int], page_size: int) -> list[bytes]:
    out: list[bytes] = []
    digest = prior or b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + page_size])
        digest = hashlib.sha256(digest + page).digest()
        out.append(digest)
    return out


def namespace_seed(salt: str) -> bytes:
    """What a salted namespace's first page chains from, as SGLang's radix cache seeds its
    event hashes: SHA-256 of a fixed tag, a NUL, and the salt."""
    return hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest()


def event_hash(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


class ZmqKvEventPublisher:
    """The engine side: a `radix.CacheEventSink` that batches a step's events and publishes
    them from a thread (PUB socket, ROUTER replay socket, a bounded replay buffer)."""

    def __init__(self, config: KvEventsConfig, page_size: int) -> None:
        self.config, self.page_size = config, page_size
        self._events: list[dict[str, Any]] = []
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if config.binds():
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ---- CacheEventSink ------------------------------------------------------------------

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
        if not digests:
            return
        self._events.append(
            {
                "type": "BlockStored",
                "block_hashes": [event_hash(d) for d in digests],
                "parent_block_hash": event_hash(parent) if parent else None,
                "token_ids": list(tokens[: len(digests) * self.page_size]),
                "block_size": self.page_size,
                "lora_id": None,
                "medium": "GPU",
                **({"cache_salt": salt} if salt is not None else {}),
            }
        )

    def removed(self, digests: list[bytes]) -> None:
        self._events.append(
            {
                "type": "BlockRemoved",
                "block_hashes": [event_hash(d) for d in digests],
                "medium": "GPU",
            }
        )

    def cleared(self) -> None:
        self._events.append({"type": "AllBlocksCleared"})

    # ---- publishing ----------------------------------------------------------------------

    def flush(self) -> None:
        """Publish this step's events as one batch (nothing when there are none)."""
        if self._events:
            batch = [time.time(), self._events, 0]
            self._events = []
            self._queue.put(msgspec.msgpack.encode(batch))

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                payload = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if payload is None:
                break
            seq_bytes = seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq_bytes, payload))
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid replay request (%d frames)", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2)
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()
