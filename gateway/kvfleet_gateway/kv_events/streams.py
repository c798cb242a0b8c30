"""Following every engine's KV-event stream into the gateway's exact prefix index.

Per healthy engine: read its `/server_info` for the `kv_events` block (SGLang advertises
the publisher's port, replay port, topic and block size there), connect a SUB socket to
`tcp://<engine host>:<port>` and a DEALER to the replay port, and apply every batch in
sequence order (`StreamState`, pure: what to apply, when to ask for a replay, when the
replica's index can be trusted).

- Connect (and every reconnect, which is what an engine restart looks like): forget the
  replica's pages and replay from sequence 0. The replica is live once the replay ends.
- A gap in sequence numbers (a dropped message, the PUB socket's slow joiner): replay from
  the first missing one.
- The engine's replay buffer has rolled over: apply from where it starts and count the
  resync as partial (pages stored before it are unknown until touched again).
- Disconnected, unhealthy, or an engine without a publisher: not live, so routing uses the
  approximate index for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvfleet_gateway.kv_events.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    decode_seq,
    encode_seq,
)
from kvfleet_gateway.metrics import GatewayMetrics
from kvfleet_gateway.routing.event_index import EventIndex

log = logging.getLogger("kvfleet.gateway.kv_events")

DESCRIBE_RETRY_S = 10.0
"""How often an engine without an advertised publisher is asked again."""
GPU_MEDIA = (None, "GPU")
"""Only pages in GPU memory count as cached for routing (host-tier copies still need a load)."""


@dataclass(frozen=True)
class Publisher:
    """An engine's KV-event publisher, as its /server_info `kv_events` block describes it."""

    port: int
    topic: str
    block_size: int
    replay_port: int | None
    dp_size: int

    @classmethod
    def from_server_info(cls, info: Any) -> Publisher | None:
        block = info.get("kv_events") if isinstance(info, dict) else None
        if not isinstance(block, dict) or block.get("publisher") != "zmq":
            return None
        try:
            replay = block.get("replay_endpoint_port_base")
            return cls(
                port=int(block["endpoint_port_base"]),
                topic=str(block.get("topic") or ""),
                block_size=int(block["block_size"]),
                replay_port=int(replay) if replay is not None else None,
                dp_size=int(block.get("dp_size") or 1),
            )
        except (KeyError, TypeError, ValueError):
            return None


class StreamState:
    """One engine's stream, in sequence order. Methods return the sequence number to ask the
    replay socket for, or None."""

    def __init__(
        self, key: str, block_size: int, index: EventIndex, metrics: GatewayMetrics, replay: bool
    ) -> None:
        self.key, self.block_size, self.index, self.metrics = key, block_size, index, metrics
        self.replay = replay
        self.next_seq: int | None = None
        self.replaying = False
        self.partial = False

    def connected(self) -> int | None:
        self.index.set_down(self.key)  # whatever it held may be gone (a restart looks so)
        self._count_live()
        self.partial = False
        if self.replay:
            self.next_seq, self.replaying = 0, True
            return 0
        self.next_seq = None  # no replay: trust what comes from now on
        self._live("partial")
        return None

    def disconnected(self) -> None:
        self.index.set_down(self.key)
        self._count_live()
        self.next_seq, self.replaying = None, False

    def message(self, seq: int, payload: bytes) -> int | None:
        if self.next_seq is None:
            self.next_seq = seq
        if seq < self.next_seq:
            return None  # already applied (a replay and the live stream overlap)
        if seq > self.next_seq:
            if self.replay and not self.replaying:
                self.replaying = True
                return self.next_seq  # the replay brings this one too
            if self.replaying:
                return None
            self._lost(seq)
        self._apply(seq, payload)
        return None

    def replayed(self, seq: int, payload: bytes) -> None:
        if seq == END_SEQ:
            self.replaying = False
            self._live("partial" if self.partial else "complete")
            return
        assert self.next_seq is not None
        if seq < self.next_seq:
            return
        if seq > self.next_seq:
            self._lost(seq)  # the engine's buffer no longer reaches back that far
        self._apply(seq, payload)

    def _lost(self, seq: int) -> None:
        log.warning(
            "KV events %s..%s from %s are lost: its pages stored before are unknown",
            self.next_seq,
            seq - 1,
            self.key,
        )
        self.partial = True
        self.next_seq = seq

    def _live(self, outcome: str) -> None:
        self.index.set_live(self.key, self.block_size)
        self._count_live()
        self.metrics.kv_event_resyncs.labels(self.key, outcome).inc()

    def _count_live(self) -> None:
        self.metrics.kv_event_streams.set(len(self.index.live_keys()))

    def _apply(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        try:
            batch: EventBatch = decode_batch(payload)
        except msgspec.DecodeError as e:
            log.warning("undecodable KV-event batch %s from %s: %s", seq, self.key, e)
            self.partial = True
            return
        index, key, count = self.index, self.key, self.metrics.kv_events.labels
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                # Salted pages are indexed as published (their hashes already chain from the
                # salt); adapter pages are not (the gateway does not hash in their namespace).
                if ev.medium in GPU_MEDIA and ev.lora_name is None and ev.lora_id is None:
                    index.stored(key, ev.block_hashes)
                count(key, "stored").inc()
            elif isinstance(ev, BlockRemoved):
                if ev.medium in GPU_MEDIA:
                    index.removed(key, ev.block_hashes)
                count(key, "removed").inc()
            elif isinstance(ev, AllBlocksCleared):
                index.cleared(key)
                count(key, "cleared").inc()
        self.metrics.kv_index_pages.labels(key).set(index.pages_held(key))


async def describe(session: aiohttp.ClientSession, url: str) -> Publisher | None:
    try:
        async with session.get(f"{url}/server_info", timeout=aiohttp.ClientTimeout(5)) as r:
            if r.status != 200:
                return None
            return Publisher.from_server_info(await r.json(content_type=None))
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def follow(
    url: str, pub: Publisher, index: EventIndex, metrics: GatewayMetrics, ctx: zmq.asyncio.Context
) -> None:
    """Apply `url`'s engine's events until cancelled."""
    host = urlsplit(url).hostname or "localhost"
    host = f"[{host}]" if ":" in host else host
    state = StreamState(url, pub.block_size, index, metrics, pub.replay_port is not None)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, pub.topic)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    sub.connect(f"tcp://{host}:{pub.port}")
    replay: zmq.asyncio.Socket | None = None
    poller = zmq.asyncio.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    if pub.replay_port is not None:
        replay = ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.LINGER, 0)
        replay.connect(f"tcp://{host}:{pub.replay_port}")
        poller.register(replay, zmq.POLLIN)

    async def ask(start: int | None) -> None:
        if start is not None and replay is not None:
            await replay.send_multipart((b"", encode_seq(start)))  # ROUTER sees id, "", seq

    try:
        while True:
            ready = dict(await poller.poll())
            if monitor in ready:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    log.info("KV-event stream of %s dropped", url)
                    state.disconnected()
                else:
                    log.info("KV-event stream of %s connected: resynchronising", url)
                    await ask(state.connected())
            if replay is not None and replay in ready:
                frames = await replay.recv_multipart()
                if len(frames) == 4:  # "", topic, seq, payload
                    state.replayed(decode_seq(frames[2]), frames[3])
            if sub in ready:
                frames = await sub.recv_multipart()
                if len(frames) == 3:
                    await ask(state.message(decode_seq(frames[1]), frames[2]))
    finally:
        index.set_down(url)
        metrics.kv_event_streams.set(len(index.live_keys()))
        sub.disable_monitor()
        for s in (monitor, sub, replay):
            if s is not None:
                s.close(linger=0)


class KvEventStreams:
    """Keeps one follower per healthy engine: started when it turns healthy, stopped when
    it leaves or fails its health checks."""

    def __init__(
        self,
        index: EventIndex,
        metrics: GatewayMetrics,
        healthy: Callable[[], list[str]],
        interval_s: float = 1.0,
    ) -> None:
        self.index, self.metrics, self.healthy, self.interval_s = (
            index,
            metrics,
            healthy,
            interval_s,
        )
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._retry_at: dict[str, float] = {}

    async def sync(self, session: aiohttp.ClientSession, ctx: zmq.asyncio.Context) -> None:
        loop = asyncio.get_running_loop()
        wanted = set(self.healthy())
        for url in list(self._tasks):
            task = self._tasks[url]
            if url not in wanted or task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                del self._tasks[url]
                self.index.set_down(url)
        for url in self._retry_at.keys() - wanted:
            del self._retry_at[url]  # gone: asked again, and logged again, if it returns
        for url in wanted - self._tasks.keys():
            if self._retry_at.get(url, 0.0) > loop.time():
                continue
            pub = await describe(session, url)
            if pub is None or pub.dp_size != 1:
                if url not in self._retry_at:
                    log.info(
                        "%s advertises no usable KV-event publisher (%s): routing to it uses"
                        " the approximate prefix index",
                        url,
                        "none" if pub is None else f"dp_size {pub.dp_size} is not supported",
                    )
                self._retry_at[url] = loop.time() + DESCRIBE_RETRY_S
                continue
            self._retry_at.pop(url, None)
            self._tasks[url] = asyncio.create_task(
                follow(url, pub, self.index, self.metrics, ctx), name=f"kv-events {url}"
            )

    @contextlib.asynccontextmanager
    async def running(self, session: aiohttp.ClientSession) -> AsyncIterator[KvEventStreams]:
        ctx = zmq.asyncio.Context()
        stop = asyncio.Event()

        async def loop() -> None:
            while not stop.is_set():
                try:
                    await self.sync(session, ctx)
                except Exception:  # keep following the others
                    log.exception("KV-event subscription sync failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval_s)

        task = asyncio.create_task(loop(), name="kv-events")
        try:
            yield self
        finally:
            stop.set()
            await task
            for t in self._tasks.values():
                t.cancel()
            for t in self._tasks.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            self._tasks.clear()
            ctx.term()
