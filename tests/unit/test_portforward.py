"""The node agent's SPDY/3 framing for port-forward (kubectl, through the real API server,
is the live peer in tests/integration/test_local_nodes.py): frames split across reads,
header blocks through one zlib context per direction with the specification's dictionary."""

import struct
import zlib

import pytest

from kvfleet_localcluster.portforward import (
    DICTIONARY,
    FLAG_FIN,
    SYN_STREAM,
    HeaderCodec,
    control_frame,
    data_frame,
    take_frames,
)


def test_the_dictionary_is_the_specifications() -> None:
    assert len(DICTIONARY) == 1423
    assert DICTIONARY.startswith(b"\x00\x00\x00\x07options\x00\x00\x00\x04head")
    assert b"\x00\x00\x00\x06200 OK\x00\x00\x00\x07version" in DICTIONARY
    assert DICTIONARY.endswith(b"charset=iso-8859-1,utf-,*,enq=0.")


def test_frames_arrive_whole_however_the_bytes_are_split() -> None:
    peer = HeaderCodec()  # the client's side: its own deflate, our inflate
    block = peer.encode({"streamType": "data", "port": "8080", "requestID": "0"})
    syn = control_frame(SYN_STREAM, 0, struct.pack(">IIH", 1, 0, 0) + block)
    wire = syn + data_frame(1, b"GET / HTTP/1.1\r\n\r\n") + data_frame(1, b"", fin=True)
    buf, frames = bytearray(), []
    for i in range(0, len(wire), 7):  # 7-byte reads
        buf += wire[i : i + 7]
        frames += list(take_frames(buf))
    assert not buf
    assert [(f.control, f.kind, f.stream_id) for f in frames] == [
        (True, SYN_STREAM, 1), (False, 0, 1), (False, 0, 1),
    ]  # fmt: skip
    ours = HeaderCodec()
    # Names arrive lower-case, as SPDY/3 requires them on the wire.
    assert ours.decode(frames[0].payload[10:]) == {
        "streamtype": "data", "port": "8080", "requestid": "0",
    }  # fmt: skip
    assert frames[1].payload == b"GET / HTTP/1.1\r\n\r\n" and frames[2].flags & FLAG_FIN
    # The second block reuses the first's compression context (a fresh inflater cannot).
    second = peer.encode({"streamtype": "error", "port": "8080", "requestid": "1"})
    assert ours.decode(second)["streamtype"] == "error"
    fresh = zlib.decompressobj(zdict=DICTIONARY)
    with pytest.raises(zlib.error):
        fresh.decompress(second)
