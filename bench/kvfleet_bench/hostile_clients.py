"""A hostile tenant's clients, as a process of their own
(`python -m kvfleet_bench.hostile_clients GATEWAY MODEL [ROUNDS [IDLE]]`), so their own CPU
never slows the honest client that measures the gateway: a key whose budget is spent
sending 1.4 MB bodies of small nested lists (0.84 s of `json.loads` each), a fresh key
sending the same, gzip bombs of it
(6 KB on the wire), idle connections and slowloris connections. The last stdout line is a
JSON object of the statuses each kind got."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import sys

import aiohttp

NEST = b"[" * 20 + b"]" * 20
HELD_S = 12.0
"""How long the idle and trickling connections wait to be closed (the gateway's default
header timeout is 10 s)."""
SPENT, FRESH = "kvf-spent", "kvf-fresh"
"""The hostile keys (tenants `spent` and `fresh`, as the bench and the test declare them)."""


def bomb(model: str) -> bytes:
    chat = {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps(chat)[:-1].encode() + (
        b', "chat_template_kwargs": {"x": [' + b",".join([NEST] * 35_000) + b"]}}"
    )


async def _client(gw: str, key: str, data: bytes, encoding: str | None, n: int) -> list[int]:
    headers = {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
    if encoding:
        headers["Content-Encoding"] = encoding
    out = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            try:
                async with s.post(gw + "/v1/chat/completions", data=data, headers=headers) as r:
                    out.append(r.status)
            except aiohttp.ClientError:
                out.append(0)
    return out


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the server closed the connection (EOF or a reset) within `seconds`, whatever
    it wrote first."""
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(65536):
                pass
        return True
    except ConnectionError:
        return True
    except TimeoutError:
        return False


async def _idle_and_slow(gw: str, n: int, seconds: float) -> int:
    """Open `n` idle and `n // 10` trickling connections and hold them; how many the gateway
    closed within `seconds`."""
    host, port = gw.removeprefix("http://").split(":")
    conns = []
    for i in range(n + n // 10):
        with contextlib.suppress(OSError):
            r, w = await asyncio.open_connection(host, int(port))
            if i >= n:
                w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Slow: ")
            conns.append((r, w))
        if i % 100 == 99:
            await asyncio.sleep(0.05)

    done = await asyncio.gather(*(closed_within(r, seconds) for r, _ in conns))
    for _, w in conns:
        w.close()
    return sum(done)


async def main(gw: str, model: str, rounds: int, idle: int) -> dict[str, object]:
    data = bomb(model)
    zipped = gzip.compress(data)
    ordinary = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    first = await _client(gw, SPENT, json.dumps(ordinary).encode(), None, 1)
    a, b, fresh, zipped_statuses, closed = await asyncio.gather(
        _client(gw, SPENT, data, None, rounds), _client(gw, SPENT, data, None, rounds),
        _client(gw, FRESH, data, None, rounds), _client(gw, FRESH, zipped, "gzip", 4 * rounds),
        _idle_and_slow(gw, idle, HELD_S),
    )  # fmt: skip
    return {"spent": first + a + b, "fresh": fresh, "gzip": zipped_statuses,
            "connections_closed": closed, "connections": idle + idle // 10}  # fmt: skip


if __name__ == "__main__":
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    idle = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], rounds, idle))))
