"""Prefill/decode disaggregation, as SGLang serves it: `--disaggregation-mode prefill|decode`.

The protocol a router speaks is SGLang's: it sends the same request to a prefill server and
a decode server, both carrying `bootstrap_host` (the prefill server's address),
`bootstrap_port` (its `--disaggregation-bootstrap-port`) and `bootstrap_room` (a number
naming this request's KV hand-off); the client reads the decode server's answer.

* A **prefill** server computes the prompt and its first token (it generates nothing more),
  then offers the KV under the room on its bootstrap port.
* A **decode** server asks the prefill server's bootstrap port for the room, waits while the
  KV crosses the link (the prompt's KV bytes per GPU over the catalogue link's per-GPU
  bandwidth, each GPU sending its shard over its own path), then admits the request with
  its KV already in place: no prefill compute, its first token out at once, decoding from
  there. A request without bootstrap fields is refused (400).

What is simulated is the timing and the admission, not the transfer engine: the hand-off
between simulated engines is an HTTP long poll on the bootstrap port, not Mooncake or NIXL
(whose flags are accepted). The prefill engine's KV stays in its radix cache after the
hand-off rather than being held until the transfer completes (SGLang frees it then).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from aiohttp import web

from kvfleet_sim.catalog import BUILTIN, LinkSpec

log = logging.getLogger("kvfleet.sim.disaggregation")
Mode = Literal["null", "prefill", "decode"]
MODES: tuple[Mode, ...] = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp")
"""SGLang 0.5.23's --disaggregation-transfer-backend choices (accepted; the timing is the
link's)."""
DEFAULT_LINK = "ib400"
"""The catalogue link a simulated engine's KV crosses unless told (`--disaggregation-link`)."""
WAIT_TIMEOUT_S = 300.0
"""How long a decode server waits for a room's KV (SGLang's
SGLANG_DISAGGREGATION_WAITING_TIMEOUT default)."""


@dataclass(frozen=True)
class DisaggConfig:
    mode: Mode = "null"
    """`--disaggregation-mode`."""
    bootstrap_port: int = 8998
    """`--disaggregation-bootstrap-port`: where a prefill server offers KV hand-offs."""
    transfer_backend: str = "mooncake"
    """`--disaggregation-transfer-backend` (accepted, not modelled apart)."""
    link: LinkSpec = field(default_factory=lambda: BUILTIN.link(DEFAULT_LINK))
    """The simulator's `--disaggregation-link`: the catalogue link the KV crosses."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--disaggregation-mode must be one of {', '.join(MODES)}")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(
                f"--disaggregation-transfer-backend must be one of {', '.join(TRANSFER_BACKENDS)}"
            )


def transfer_seconds(
    prompt_tokens: int, kv_bytes_per_token_per_gpu: float, link: LinkSpec
) -> float:
    """Time for a prompt's KV to cross the link: each of the prefill engine's GPUs sends its
    shard in parallel over its own path."""
    return link.setup_latency_s + prompt_tokens * kv_bytes_per_token_per_gpu / link.bandwidth


@dataclass(frozen=True)
class Bootstrap:
    host: str
    port: int
    room: int


def bootstrap_of(body: Any) -> Bootstrap | None:
    """The router's PD fields of a request body (None when absent or malformed)."""
    if not isinstance(body, dict):
        return None
    host, port, room = (
        body.get("bootstrap_host"),
        body.get("bootstrap_port"),
        body.get("bootstrap_room"),
    )
    if not isinstance(host, str) or isinstance(room, bool) or not isinstance(room, int):
        return None
    if port is None:
        port = DisaggConfig.bootstrap_port
    if isinstance(port, bool) or not isinstance(port, int):
        return None
    return Bootstrap(host, port, room)


@dataclass(frozen=True)
class HandOff:
    """What a decode server learns of a room from the prefill server."""

    prompt_tokens: int
    cached_tokens: int
    transfer_s: float
    """Simulated seconds for the KV to cross the link."""

    def to_json(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "transfer_s": self.transfer_s}  # fmt: skip


@dataclass
class Rooms:
    """A prefill server's rooms: each request's hand-off, offered once its prefill is done."""

    _offers: dict[int, asyncio.Future[HandOff]] = field(default_factory=dict)

    def _future(self, room: int) -> asyncio.Future[HandOff]:
        if room not in self._offers:
            self._offers[room] = asyncio.get_running_loop().create_future()
        return self._offers[room]

    def offer(self, room: int, hand_off: HandOff) -> None:
        future = self._future(room)
        if not future.done():
            future.set_result(hand_off)
        # A decode server that never comes (its request failed) must not leak the room.
        asyncio.get_running_loop().call_later(WAIT_TIMEOUT_S, self._offers.pop, room, None)

    async def take(self, room: int, timeout_s: float) -> HandOff | None:
        try:
            return await asyncio.wait_for(asyncio.shield(self._future(room)), timeout_s)
        except TimeoutError:
            return None
        finally:
            future = self._offers.get(room)
            if future is not None and future.done():
                self._offers.pop(room, None)

    def app(self) -> web.Application:
        """The bootstrap port's API: `GET /kv/{room}` answers when the room's KV is ready."""

        async def kv(request: web.Request) -> web.Response:
            try:
                room = int(request.match_info["room"])
                timeout = float(request.query.get("timeout", WAIT_TIMEOUT_S))
            except ValueError:
                return web.json_response({"error": "room and timeout are numbers"}, status=400)
            hand_off = await self.take(room, timeout)
            if hand_off is None:
                return web.json_response({"error": f"no KV for room {room}"}, status=404)
            return web.json_response(hand_off.to_json())

        app = web.Application()
        app.router.add_get("/kv/{room}", kv)
        return app


async def fetch_hand_off(boot: Bootstrap, timeout_s: float = WAIT_TIMEOUT_S) -> HandOff:
    """A decode server's wait for its room (raises ConnectionError when it never comes)."""
    url = f"http://{boot.host}:{boot.port}/kv/{boot.room}"
    timeout = aiohttp.ClientTimeout(total=timeout_s + 5)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as s,
            s.get(url, params={"timeout": str(timeout_s)}) as r,
        ):
            if r.status != 200:
                raise ConnectionError(f"prefill server {boot.host}:{boot.port}: {await r.text()}")
            body = await r.json()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ConnectionError(f"prefill server {boot.host}:{boot.port}: {exc}") from exc
    return HandOff(int(body["prompt_tokens"]), int(body["cached_tokens"]),
                   float(body["transfer_s"]))  # fmt: skip


@contextlib.asynccontextmanager
async def bootstrap_server(rooms: Rooms, host: str, port: int) -> Any:
    runner = web.AppRunner(rooms.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("prefill server: KV hand-offs on %s:%d", host, port)
    try:
        yield
    finally:
        await runner.cleanup()
