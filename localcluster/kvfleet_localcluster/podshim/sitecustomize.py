"""Loaded first by every Python process the local cluster's kubelet starts (via PYTHONPATH):
the pod's own network and mount namespaces, emulated inside the process.

* Network: a listening socket bound to the wildcard (`0.0.0.0`, `::`, `""`) is bound to the
  pod's address instead, so three pods that all listen on 0.0.0.0:30000 each get their own
  127.0.0.x:30000, as three pods on a real node do. (An IPv6-only wildcard socket, which
  no pod address here could serve, gets a private port on ::1.) ZeroMQ binds in C, so its
  `tcp://*:PORT` endpoints are rewritten to the pod's address where pyzmq is installed.
* Mounts: paths under the mount paths the kubelet lists — the service-account volume at
  /var/run/secrets/kubernetes.io/serviceaccount, whose path client libraries hard-code —
  open the pod's copy of that volume.

* DNS: `<service>.<namespace>.svc[.cluster.local]`, `<service>.<namespace>` and, from the
  pod's own namespace, `<service>` resolve through the node's Service table
  (`kvfleet_localcluster/services.py`): to a Ready pod of the Service, at the targetPort its
  port maps to — what cluster DNS and kube-proxy do together. A pod with `hostname` and
  `subdomain` under a headless Service resolves as `<hostname>.<subdomain>.<namespace>[.svc]`.

Configured by the kubelet through KVFLEET_POD_IP, KVFLEET_POD_MOUNTS (JSON: mountPath →
directory), KVFLEET_SERVICE_TABLE (a file) and KVFLEET_POD_NAMESPACE. Nothing here runs
outside a local-cluster pod.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import random
import socket
import ssl
from typing import Any

_POD_IP = os.environ.get("KVFLEET_POD_IP", "")
_MOUNTS: dict[str, str] = json.loads(os.environ.get("KVFLEET_POD_MOUNTS") or "{}")
_WILDCARD = {"", "0.0.0.0", "::", "::0", "0:0:0:0:0:0:0:0"}
_SERVICE_TABLE = os.environ.get("KVFLEET_SERVICE_TABLE", "")
_NAMESPACE = os.environ.get("KVFLEET_POD_NAMESPACE", "default")
_table: tuple[float, dict[str, Any]] = (-1.0, {})


def _services() -> dict[str, Any]:
    """The Service table, re-read when the file changes."""
    global _table
    try:
        mtime = os.stat(_SERVICE_TABLE).st_mtime
    except OSError:
        return {}
    if mtime != _table[0]:
        with open(_SERVICE_TABLE) as f:
            _table = (mtime, json.load(f))
    return _table[1]


def _service_address(host: Any, port: Any) -> tuple[str, Any] | None:
    """(address, port) for a Service name, or None for any other name."""
    if not isinstance(host, str | bytes):
        return None
    name = (host.decode() if isinstance(host, bytes) else host).rstrip(".").lower()
    for suffix in (".svc.cluster.local", ".svc"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    if "." not in name:
        name = f"{name}.{_NAMESPACE}"
    doc = _services()
    endpoints = (doc.get("services") or {}).get(name)  # a Service, or a pod of a headless one
    if endpoints is None:
        return None
    if not endpoints:
        return doc.get("noEndpoints", "127.255.255.254"), port
    chosen = random.choice(endpoints)
    mapped = chosen["ports"].get(str(port)) if port is not None else None
    return chosen["ip"], mapped if mapped is not None else port


def _cluster_dns(original: Any) -> Any:
    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        found = _service_address(host, port)
        if found is not None:
            host, port = found
        return original(host, port, *args, **kwargs)

    return getaddrinfo


def _uvloop_dns(getaddrinfo: Any, create_connection: Any) -> tuple[Any, Any]:
    """uvloop resolves in C, past `socket.getaddrinfo`: map the names on its Python entry
    points (aiohttp resolves through `loop.getaddrinfo`; asyncio streams, such as redis's,
    connect through `loop.create_connection`)."""

    async def resolve(self: Any, host: Any, port: Any = None, *args: Any, **kwargs: Any) -> Any:
        found = _service_address(host, port)
        if found is not None:
            host, port = found
        return await getaddrinfo(self, host, port, *args, **kwargs)

    async def connect(
        self: Any, factory: Any, host: Any = None, port: Any = None, **kw: Any
    ) -> Any:
        found = _service_address(host, port)
        if found is not None:
            host, port = found
        return await create_connection(self, factory, host, port, **kw)

    return resolve, connect


def _pod_bind(original: Any) -> Any:
    def bind(self: socket.socket, address: Any) -> None:
        if isinstance(address, tuple) and address and address[0] in _WILDCARD:
            if self.family == socket.AF_INET:
                address = (_POD_IP, *address[1:])
            elif self.family == socket.AF_INET6:
                v6only = self.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
                if v6only:
                    address = ("::1", 0, *address[2:])
                else:
                    address = (f"::ffff:{_POD_IP}", *address[1:])
        original(self, address)

    return bind


def _zmq_bind(original: Any) -> Any:
    def bind(self: Any, addr: Any) -> Any:
        text = addr.decode() if isinstance(addr, bytes) else addr
        if isinstance(text, str) and text.startswith("tcp://"):
            host, sep, port = text[len("tcp://") :].rpartition(":")
            if sep and host in ("*", "0.0.0.0", "[::]", "::"):
                addr = f"tcp://{_POD_IP}:{port}"
        return original(self, addr)

    return bind


def _mapped(path: Any) -> Any:
    if isinstance(path, bytes):
        return os.fsencode(_mapped(os.fsdecode(path)))
    if not isinstance(path, str | os.PathLike):
        return path
    text = os.fspath(path)
    if not isinstance(text, str):
        return path
    for mount in sorted(_MOUNTS, key=len, reverse=True):
        if text == mount or text.startswith(mount.rstrip("/") + "/"):
            return _MOUNTS[mount] + text[len(mount.rstrip("/")) :]
    return path


def _wrap_path_call(original: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = (_mapped(args[0]), *args[1:])
        return original(*args, **kwargs)

    return call


def _pod_server(original: Any) -> Any:
    """`loop.create_server(host=None | "0.0.0.0" | "::", ...)` listens on the pod's address.
    Needed besides `bind`: uvloop binds in C, where no Python patch reaches."""

    async def create_server(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) >= 2:
            host = args[1]
            if host is None or host in _WILDCARD or (isinstance(host, list) and not host):
                args = (args[0], _POD_IP, *args[2:])
        elif "host" in kwargs or len(args) == 1:
            host = kwargs.get("host")
            if kwargs.get("sock") is None and (host is None or host in _WILDCARD):
                kwargs["host"] = _POD_IP
        return await original(self, *args, **kwargs)

    return create_server


if _POD_IP:
    socket.socket.bind = _pod_bind(socket.socket.bind)  # type: ignore[method-assign]
    import asyncio

    _base = asyncio.BaseEventLoop
    _base.create_server = _pod_server(_base.create_server)  # type: ignore[method-assign]
    try:
        import uvloop
    except ImportError:
        pass
    else:
        uvloop.Loop.create_server = _pod_server(uvloop.Loop.create_server)  # type: ignore[method-assign]
    try:
        import zmq
    except ImportError:
        pass
    else:
        zmq.Socket.bind = _zmq_bind(zmq.Socket.bind)  # type: ignore[method-assign]

if _SERVICE_TABLE:
    socket.getaddrinfo = _cluster_dns(socket.getaddrinfo)
    try:
        import uvloop
    except ImportError:
        pass
    else:
        uvloop.Loop.getaddrinfo, uvloop.Loop.create_connection = _uvloop_dns(  # type: ignore[method-assign]
            uvloop.Loop.getaddrinfo, uvloop.Loop.create_connection
        )

if _MOUNTS:
    builtins.open = io.open = _wrap_path_call(io.open)
    for _name in ("open", "stat", "lstat", "access", "listdir", "scandir"):
        setattr(os, _name, _wrap_path_call(getattr(os, _name)))
    _load_verify = ssl.SSLContext.load_verify_locations

    def _load_verify_locations(
        self: ssl.SSLContext, cafile: Any = None, capath: Any = None, cadata: Any = None
    ) -> None:
        _load_verify(self, _mapped(cafile), _mapped(capath), cadata)

    ssl.SSLContext.load_verify_locations = _load_verify_locations  # type: ignore[method-assign]
    _load_chain = ssl.SSLContext.load_cert_chain

    def _load_cert_chain(
        self: ssl.SSLContext, certfile: Any, keyfile: Any = None, password: Any = None
    ) -> None:
        _load_chain(self, _mapped(certfile), _mapped(keyfile), password)

    ssl.SSLContext.load_cert_chain = _load_cert_chain  # type: ignore[method-assign,assignment]
