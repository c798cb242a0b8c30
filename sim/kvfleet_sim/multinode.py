"""One engine across several nodes, as SGLang runs it: `--nnodes N --node-rank R
--dist-init-addr HOST:PORT`.

Every node runs the same command with its own rank. They meet at the rank-0 node's
`--dist-init-addr` (torch.distributed's rendezvous) before anything serves: rank 0's
HTTP API answers `/health` 503 until every rank has joined; a rank >= 1 serves only SGLang's
stand-in health server (`/health`, `/ping`, `/health_generate`, `/metrics` with no engine
series) — and only once it has joined, as SGLang starts it after its schedulers. A rank lost
after joining ends the engine on every node (NCCL aborts a collective whose peer is gone):
rank 0 exits when a worker's connection drops, a worker exits when rank 0's does, and the
orchestrator (LeaderWorkerSet) starts the group again.

What is simulated is the rendezvous and its failure modes; the engine itself is one
simulated engine on rank 0 of `--tp-size` GPUs (the group's total), whose speed the
catalogue's tensor-parallel model gives (inter-node links are not modelled apart).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field

from aiohttp import web

log = logging.getLogger("kvfleet.sim.multinode")
JOIN_RETRY_S = 1.0


class DistConfigError(ValueError):
    pass


@dataclass(frozen=True)
class DistConfig:
    """SGLang's multi-node flags."""

    nnodes: int = 1
    """`--nnodes`: nodes in one engine."""
    node_rank: int = 0
    """`--node-rank`: this node's rank (0 serves the API)."""
    dist_init_addr: str | None = None
    """`--dist-init-addr`: `host:port` of rank 0's rendezvous."""

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise DistConfigError("--nnodes must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise DistConfigError(f"--node-rank must be in [0, {self.nnodes - 1}]")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise DistConfigError("--nnodes > 1 needs --dist-init-addr HOST:PORT")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise DistConfigError(
                    f"--dist-init-addr {self.dist_init_addr!r}: expected HOST:PORT"
                )

    @property
    def address(self) -> tuple[str, int]:
        assert self.dist_init_addr is not None
        host, _, port = self.dist_init_addr.rpartition(":")
        return host.strip("[]"), int(port)


def abort(reason: str) -> None:
    """A collective lost a peer: the process ends at once, as an aborted NCCL job does."""
    log.error("distributed engine aborted: %s", reason)
    os._exit(1)


@dataclass
class Rendezvous:
    """Rank 0's side: accepts the other ranks; complete when all have joined."""

    config: DistConfig
    joined: set[int] = field(default_factory=set)
    _server: asyncio.Server | None = None

    @property
    def complete(self) -> bool:
        return len(self.joined) == self.config.nnodes - 1

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._peer, "0.0.0.0", self.config.address[1])
        log.info("rank 0: waiting for %d ranks at %s", self.config.nnodes - 1, self.config.address)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        words = line.decode(errors="replace").split()
        if len(words) != 2 or words[0] != "rank" or not words[1].isdigit():
            writer.close()
            return
        rank = int(words[1])
        if not 0 < rank < self.config.nnodes or rank in self.joined:
            writer.write(b"refused\n")
            writer.close()
            return
        self.joined.add(rank)
        writer.write(b"joined\n")
        await writer.drain()
        log.info("rank %d joined (%d of %d)", rank, len(self.joined) + 1, self.config.nnodes)
        await reader.read()  # until the rank's connection ends
        abort(f"rank {rank} left the group")


async def join(
    config: DistConfig, timeout_s: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A rank >= 1 joins rank 0 (retrying while rank 0 is not up yet, as torch does)."""
    host, port = config.address
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(f"rank {config.node_rank}\n".encode())
            await writer.drain()
            if (await reader.readline()).strip() == b"joined":
                log.info("rank %d joined rank 0 at %s:%d", config.node_rank, host, port)
                return reader, writer  # the writer too: dropping it closes the connection
            writer.close()
        except OSError:
            pass
        if asyncio.get_running_loop().time() > deadline:
            abort(f"rank 0 at {host}:{port} not reachable in {timeout_s:.0f} s")
        await asyncio.sleep(JOIN_RETRY_S)


def _health_app() -> web.Application:
    """SGLang's health server of a rank >= 1: liveness only, no API, no engine metrics."""

    async def ok(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="", content_type="text/plain")

    app = web.Application()
    for path in ("/health", "/ping", "/health_generate"):
        app.router.add_get(path, ok)
    app.router.add_get("/metrics", metrics)
    return app


async def serve_worker(config: DistConfig, host: str, port: int, timeout_s: float) -> None:
    """A rank >= 1: join, then serve health until rank 0 goes (then end, as SGLang's does)."""
    leader, _connection = await join(config, timeout_s)
    runner = web.AppRunner(_health_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    with contextlib.suppress(ConnectionError):
        await leader.read()
    abort("rank 0 left the group")
