"""Serving the gateway app: aiohttp's runner, with error pages that never quote a request.

aiohttp answers a request it cannot parse (a header with a control byte, say) with a 400
whose body is the parser's message — and that message quotes the offending line, so an
`Authorization` header with a stray byte echoed the whole API key back (to whoever sent it,
and to any proxy log on the way). The handler below answers such requests with the status
line's phrase only.

It also guards connections, which anyone can open without a key (`listen.connections`): at
most so many per client address and in all (more are closed as they open), a deadline for
each request's headers from its first byte (a slowloris client trickling a header a minute is
cut off), and an idle keep-alive timeout (aiohttp's own default is an hour).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from kvfleet_gateway.config import Connections
from kvfleet_gateway.state import GATEWAY

log = logging.getLogger("kvfleet.gateway")


@dataclass
class ConnectionGuard:
    """Open connections by client address and in all, shared by a server's handlers."""

    limits: Connections
    by_address: Counter[str] = field(default_factory=Counter)
    total: int = 0
    refused: int = 0
    """Connections closed as they opened, over a cap."""
    slow_headers: int = 0
    """Connections closed because a request's headers did not arrive in time."""

    def admit(self, address: str) -> bool:
        if self.total >= self.limits.max_total or (
            self.by_address[address] >= self.limits.max_per_address
        ):
            self.refused += 1
            return False
        self.by_address[address] += 1
        self.total += 1
        return True

    def release(self, address: str) -> None:
        self.total -= 1
        self.by_address[address] -= 1
        if not self.by_address[address]:
            del self.by_address[address]


class _GuardedHandler(RequestHandler):
    guard: ConnectionGuard | None = None
    _address: str | None = None
    _head_timer: asyncio.TimerHandle | None = None
    _head_count: int = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if self.guard is not None and not self.guard.admit(address):
            transport.close()  # over a cap: nothing is read, nothing is answered
            return
        self._address = address
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        count = self._request_count
        super().data_received(data)
        if self._request_count > count:  # a request's headers are complete
            self._disarm_head_timer()
        elif self._head_timer is None and self._current_request is None and not self._messages:
            self._arm_head_timer()  # the first bytes of the next request on this connection

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_head_timer()
        if self.guard is not None and self._address is not None:
            self.guard.release(self._address)
            self._address = None
        if self.transport is not None or self._task_handler is not None:
            super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self.guard is None:
            return
        self._head_count = self._request_count
        wait = float(self.guard.limits.header_timeout)
        self._head_timer = self._loop.call_later(wait, self._headers_too_slow)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _headers_too_slow(self) -> None:
        self._head_timer = None
        if self._request_count == self._head_count and self._current_request is None:
            assert self.guard is not None
            self.guard.slow_headers += 1
            log.info(
                "closed a connection from %s: no complete request headers within %gs",
                self._address, self.guard.limits.header_timeout,
            )  # fmt: skip
            self.force_close()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if 400 <= status < 500:
            message = f"{status} {HTTPStatus(status).phrase}"
        return super().handle_error(request, status, exc, message)


class _Server(web.Server):
    guard: ConnectionGuard | None = None

    def __call__(self) -> RequestHandler:
        handler = _GuardedHandler(self, loop=self._loop, **self._kwargs)
        handler.guard = self.guard
        return handler


class GatewayRunner(web.AppRunner):
    """Serves a gateway app with its own config's connection limits and keep-alive, and with
    aiohttp's inflating of compressed bodies only where the config accepts them (refused
    unread, a 6 KB gzip bomb would otherwise cost megabytes of work)."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        config = app[GATEWAY].config
        connections = config.listen.connections
        kwargs.setdefault("auto_decompress", config.requests.compressed_bodies)
        kwargs.setdefault("keepalive_timeout", float(connections.keepalive_timeout))
        super().__init__(app, **kwargs)
        self.guard = ConnectionGuard(connections)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp builds its Server inside Application; only the connection handler it
        # makes differs here, so the instance takes our subclass.
        server.__class__ = _Server
        assert isinstance(server, _Server)
        server.guard = self.guard
        return server


def run(
    app: web.Application,
    host: str,
    port: int,
    drain_s: float,
    **kw: Any,
) -> None:
    """Serve until SIGTERM/SIGINT, then stop accepting and give requests in flight `drain_s`
    to finish (as `web.run_app` does)."""
    runner = GatewayRunner(
        app, handle_signals=True, access_log=None, shutdown_timeout=drain_s, **kw
    )
    with asyncio.Runner() as loop_runner:
        try:
            loop_runner.run(_start(runner, host, port))
            loop_runner.get_loop().run_forever()
        except (web.GracefulExit, KeyboardInterrupt):
            pass
        finally:
            loop_runner.run(runner.cleanup())


async def _start(runner: GatewayRunner, host: str, port: int) -> None:
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
