"""Serving the gateway app: aiohttp's runner, with error pages that never quote a request.

aiohttp answers a request it cannot parse (a header with a control byte, say) with a 400
whose body is the parser's message — and that message quotes the offending line, so an
`Authorization` header with a stray byte echoed the whole API key back (to whoever sent it,
and to any proxy log on the way). The handler below answers such requests with the status
line's phrase only.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest


class _PlainErrors(RequestHandler):
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
    def __call__(self) -> RequestHandler:
        return _PlainErrors(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp builds its Server inside Application; only the connection handler it
        # makes differs here, so the instance takes our subclass.
        server.__class__ = _Server
        return server


def run(app: web.Application, host: str, port: int, drain_s: float, **kw: Any) -> None:
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
