"""A kubelet's `portForward`: `kubectl port-forward pod/x` and `svc/x` on the local cluster.

kubectl 1.37 dials the API server's `pods/portforward` as SPDY/3.1 tunnelled through a
WebSocket; the real API server translates that to a plain `Upgrade: SPDY/3.1` request to the
pod's node — the node agent's kubelet API (`kubelet_api.py`), which serves it here. (`svc/x`
is resolved to one of its pods by kubectl itself, so only pods are forwarded.)

The port-forward protocol (`portforward.k8s.io`): for each local connection the client opens
two SPDY streams with headers `streamtype: error|data`, `port` and `requestid`; when both
have arrived, the node connects to the pod's address at that port and copies bytes both ways
over the data stream. A failure to connect is written as text on the error stream; a clean
end closes both (an error stream closed empty means no error).

SPDY/3 framing (control frames: version 3, a type, flags, a 24-bit length; data frames: a
31-bit stream id, flags, a 24-bit length) with name/value header blocks compressed by zlib
against the dictionary the SPDY/3 specification fixes, one compression context per
direction for the whole session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import aiohttp.web

log = logging.getLogger("kvfleet.localcluster.portforward")

PROTOCOL = "portforward.k8s.io"
VERSION = 3
SYN_STREAM, SYN_REPLY, RST_STREAM, PING, GOAWAY = 1, 2, 3, 6, 7
FLAG_FIN = 0x01
RST_INVALID_STREAM = 2
CHUNK = 32 * 1024
"""Bytes per DATA frame from the pod."""

# The SPDY/3 header dictionary (draft-mbelshe-httpbis-spdy-00, 2.6.10.1): these tokens,
# each preceded by its length as 4 big-endian bytes, then this text as it is.
_TOKENS = (
    "options head post put delete trace accept accept-charset accept-encoding accept-language "
    "accept-ranges age allow authorization cache-control connection content-base "
    "content-encoding content-language content-length content-location content-md5 "
    "content-range content-type date etag expect expires from host if-match "
    "if-modified-since if-none-match if-range if-unmodified-since last-modified location "
    "max-forwards pragma proxy-authenticate proxy-authorization range referer retry-after "
    "server te trailer transfer-encoding upgrade user-agent vary via warning "
    "www-authenticate method get status 200|OK version HTTP/1.1 url public set-cookie "
    "keep-alive origin"
)
_TAIL = (
    "100101201202205206300302303304305306307402405406407408409410411412413414415416417502504"
    "505203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request"
    "401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented"
    "503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 Mon, "
    "Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,image/jpg,image/gif,"
    "application/xml,application/xhtml+xml,text/plain,text/javascript,publicprivatemax-age="
    "gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0."
)


def spdy_dictionary() -> bytes:
    """The dictionary's 1,423 bytes (`|` in a token stands for a space)."""
    tokens = [w.replace("|", " ") for w in _TOKENS.split()]
    return b"".join(struct.pack(">I", len(t)) + t.encode() for t in tokens) + _TAIL.encode()


DICTIONARY = spdy_dictionary()


@dataclass(frozen=True)
class Frame:
    control: bool
    kind: int
    """The control frame's type; 0 for a data frame."""
    flags: int
    stream_id: int
    """A data frame's stream; for control frames that carry one, its stream id."""
    payload: bytes


def take_frames(buf: bytearray) -> Iterator[Frame]:
    """The complete frames at the front of `buf`, consumed from it as they are read."""
    while len(buf) >= 8:
        length = int.from_bytes(buf[5:8], "big")
        if len(buf) < 8 + length:
            return
        head, payload = bytes(buf[:8]), bytes(buf[8 : 8 + length])
        del buf[: 8 + length]
        flags = head[4]
        if head[0] & 0x80:
            kind = int.from_bytes(head[2:4], "big")
            sid = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF if len(payload) >= 4 else 0
            yield Frame(True, kind, flags, sid, payload)
        else:
            yield Frame(False, 0, flags, int.from_bytes(head[:4], "big") & 0x7FFFFFFF, payload)


def control_frame(kind: int, flags: int, payload: bytes) -> bytes:
    return struct.pack(">HHI", 0x8000 | VERSION, kind, (flags << 24) | len(payload)) + payload


def data_frame(stream_id: int, data: bytes, fin: bool = False) -> bytes:
    flags = FLAG_FIN if fin else 0
    return struct.pack(">II", stream_id & 0x7FFFFFFF, (flags << 24) | len(data)) + data


@dataclass
class HeaderCodec:
    """Name/value blocks: a count, then length-prefixed names and values (lower-case names,
    several values joined by NUL), zlib-compressed with the dictionary, one stream per way."""

    _inflate: zlib._Decompress = field(default_factory=lambda: zlib.decompressobj(zdict=DICTIONARY))
    _deflate: zlib._Compress = field(
        default_factory=lambda: zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zdict=DICTIONARY)
    )

    def decode(self, block: bytes) -> dict[str, str]:
        raw = self._inflate.decompress(block)
        count, pos, out = int.from_bytes(raw[:4], "big"), 4, {}
        for _ in range(count):
            n = int.from_bytes(raw[pos : pos + 4], "big")
            name = raw[pos + 4 : pos + 4 + n].decode().lower()
            pos += 4 + n
            n = int.from_bytes(raw[pos : pos + 4], "big")
            out[name] = raw[pos + 4 : pos + 4 + n].decode()
            pos += 4 + n
        return out

    def encode(self, headers: dict[str, str]) -> bytes:
        raw = struct.pack(">I", len(headers))
        for name, value in headers.items():
            raw += struct.pack(">I", len(name)) + name.lower().encode()
            raw += struct.pack(">I", len(value.encode())) + value.encode()
        return self._deflate.compress(raw) + self._deflate.flush(zlib.Z_SYNC_FLUSH)


@dataclass
class _Pair:
    """One forwarded connection: kubectl's error and data streams of one request id."""

    port: int
    error: int | None = None
    data: int | None = None
    writer: asyncio.StreamWriter | None = None
    pump: asyncio.Task[None] | None = None


class Session:
    """One port-forward connection: SPDY frames in, SPDY frames out, over the upgraded
    connection from the API server (`send` and `close` act on it)."""

    def __init__(
        self,
        send: Callable[[bytes], Awaitable[None]],
        close: Callable[[], Awaitable[None]],
        pod_ip: str,
        ports: set[int],
    ) -> None:
        self._send, self._close, self.pod_ip, self.ports = send, close, pod_ip, ports
        self.codec = HeaderCodec()
        self.pairs: dict[str, _Pair] = {}
        self.by_stream: dict[int, _Pair] = {}
        self._send_lock = asyncio.Lock()

    async def send(self, frame: bytes) -> None:
        async with self._send_lock:
            await self._send(frame)

    async def run(self, chunks: AsyncIterator[bytes]) -> None:
        buf = bytearray()
        try:
            async for chunk in chunks:
                buf += chunk
                for frame in take_frames(buf):
                    await self._on_frame(frame)
        finally:
            for pair in self.pairs.values():
                if pair.pump is not None:
                    pair.pump.cancel()
                if pair.writer is not None:
                    pair.writer.close()

    async def _on_frame(self, frame: Frame) -> None:
        if not frame.control:
            await self._on_data(frame)
        elif frame.kind == SYN_STREAM:
            await self._on_stream(frame.stream_id, self.codec.decode(frame.payload[10:]))
        elif frame.kind == PING:
            await self.send(control_frame(PING, 0, frame.payload[:4]))
        elif frame.kind == RST_STREAM:
            pair = self.by_stream.get(frame.stream_id)
            if pair is not None and pair.writer is not None:
                pair.writer.close()
        elif frame.kind == GOAWAY:
            await self._close()
        # SETTINGS, WINDOW_UPDATE, HEADERS: nothing to do for a forwarded byte stream.

    async def _on_stream(self, sid: int, headers: dict[str, str]) -> None:
        await self.send(control_frame(SYN_REPLY, 0, struct.pack(">I", sid) + self.codec.encode({})))
        kind, request = headers.get("streamtype"), headers.get("requestid", "")
        try:
            port = int(headers.get("port", ""))
        except ValueError:
            port = 0
        pair = self.pairs.setdefault(request, _Pair(port))
        self.by_stream[sid] = pair
        if kind == "error":
            pair.error = sid
        elif kind == "data":
            pair.data = sid
        else:
            await self.send(
                control_frame(RST_STREAM, 0, struct.pack(">II", sid, RST_INVALID_STREAM))
            )
            return
        if pair.error is not None and pair.data is not None:
            await self._connect(pair)

    async def _connect(self, pair: _Pair) -> None:
        assert pair.error is not None and pair.data is not None
        if not 0 < pair.port < 65536 or (self.ports and pair.port not in self.ports):
            await self._fail(
                pair, f"port {pair.port} was not requested (ports: {sorted(self.ports)})"
            )
            return
        try:
            reader, pair.writer = await asyncio.open_connection(self.pod_ip, pair.port)
        except OSError as exc:
            await self._fail(
                pair, f"failed to connect to {self.pod_ip}:{pair.port} inside the pod: {exc}"
            )
            return
        pair.pump = asyncio.create_task(self._pump(pair, reader))

    async def _fail(self, pair: _Pair, message: str) -> None:
        assert pair.error is not None and pair.data is not None
        log.warning("port-forward: %s", message)
        await self.send(data_frame(pair.error, message.encode(), fin=True))
        await self.send(data_frame(pair.data, b"", fin=True))

    async def _pump(self, pair: _Pair, reader: asyncio.StreamReader) -> None:
        """The pod's bytes to kubectl; at their end both streams close (no error)."""
        assert pair.error is not None and pair.data is not None
        with contextlib.suppress(OSError, ConnectionError):
            while chunk := await reader.read(CHUNK):
                await self.send(data_frame(pair.data, chunk))
        await self.send(data_frame(pair.data, b"", fin=True))
        await self.send(data_frame(pair.error, b"", fin=True))

    async def _on_data(self, frame: Frame) -> None:
        pair = self.by_stream.get(frame.stream_id)
        if pair is None or frame.stream_id != pair.data or pair.writer is None:
            return  # the error stream's half-close, or a stream already done
        with contextlib.suppress(OSError, ConnectionError):
            if frame.payload:
                pair.writer.write(frame.payload)
                await pair.writer.drain()
            if frame.flags & FLAG_FIN and pair.writer.can_write_eof():
                pair.writer.write_eof()


class _RawFeed:
    """Bytes of an upgraded HTTP connection, as aiohttp's protocol hands them to a parser (the
    way its WebSocket reader receives them), into a queue; None at the end."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        self.queue.put_nowait(bytes(data))
        return False, b""

    def feed_eof(self) -> None:
        self.queue.put_nowait(None)

    async def chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self.queue.get()) is not None:
            yield chunk


async def serve_upgraded(raw: aiohttp.web.BaseRequest, pod_ip: str) -> aiohttp.web.StreamResponse:
    """A kubelet's `portForward`: the API server asks for `Upgrade: SPDY/3.1` with the
    port-forward protocol and then speaks SPDY frames on the bare connection (it translates
    kubectl's WebSocket tunnel to this)."""
    if raw.headers.get("Upgrade", "").lower() != "spdy/3.1":
        raise aiohttp.web.HTTPBadRequest(text="port-forward needs an SPDY/3.1 upgrade")
    ports = {int(p) for p in raw.query.getall("port", []) if p.isdigit()}
    resp = aiohttp.web.StreamResponse(
        status=101,
        headers={
            "Connection": "Upgrade",
            "Upgrade": "SPDY/3.1",
            "X-Stream-Protocol-Version": PROTOCOL,
        },
    )
    await resp.prepare(raw)
    transport, feed = raw.transport, _RawFeed()
    assert transport is not None
    raw.protocol.set_parser(feed)  # type: ignore[arg-type]  # any feed_data/feed_eof parser

    async def send(frame: bytes) -> None:
        if not transport.is_closing():
            transport.write(frame)

    async def close() -> None:
        transport.close()

    await Session(send, close, pod_ip, ports).run(feed.chunks())
    return resp
