"""Small helpers shared by the product commands."""

from __future__ import annotations

import asyncio
import errno
import socket

import click


def use_uvloop() -> None:
    """Serve on uvloop where it is installed: the same asyncio API, much cheaper sockets."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def check_port_free(host: str, port: int, flag: str, field: str | None = None) -> None:
    """Fail in one line, naming the port and the flag that moves it, when another process
    listens there (the gateway's metrics default, 9090, is also Prometheus's; the operator's,
    8081, another operator's on the same host)."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise click.ClickException(f"cannot listen on {host}: {exc.strerror} (--host)") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            try:
                probe.bind(address)
            except OSError as exc:
                in_use = exc.errno == errno.EADDRINUSE
                what = "is in use" if in_use else f"cannot be bound ({exc.strerror})"
                raise click.ClickException(
                    f"port {port} on {host} {what}: choose another with {flag} PORT"
                    + (f" (or {field} in --config)" if field else "")
                ) from None
