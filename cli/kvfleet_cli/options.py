"""Small helpers shared by the product commands."""

from __future__ import annotations

import asyncio


def use_uvloop() -> None:
    """Serve on uvloop where it is installed: the same asyncio API, much cheaper sockets."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
