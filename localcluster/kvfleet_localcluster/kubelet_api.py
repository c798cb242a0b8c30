"""The kubelet API a node agent serves, which the API server dials for `kubectl logs` and
`kubectl port-forward` (and refuses politely for `kubectl exec`): HTTPS on the port the
Node's `daemonEndpoints` names.

`/portForward/<namespace>/<pod>` upgrades to SPDY/3.1 and forwards the pod's ports
(`portforward.py`). `GET /containerLogs/<namespace>/<pod>/<container>` takes the parameters
the API server passes on from pods/log (`follow`, `previous`, `tailLines`, `limitBytes`)
and streams the file the node keeps for that run of the container. Pods here are processes,
not containers: there is nothing to exec into or attach to, and the answer says so instead
of hanging up.
"""

from __future__ import annotations

import ssl
from typing import Any, Protocol

import aiohttp.web

from kvfleet_localcluster import portforward
from kvfleet_localcluster.apitypes import ApiError
from kvfleet_localcluster.logs import LogSource, serve_logs

NO_EXEC = (
    "{verb} is not supported on the kvfleet local cluster: its pods are local processes, "
    "not containers; read the pod's log (kubectl logs) or port-forward to it instead"
)


class PodLogs(LogSource, Protocol):
    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A pod bound to this node, as last seen."""
        ...


def make_app(node: PodLogs) -> aiohttp.web.Application:
    async def container_logs(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        ns, name = request.match_info["namespace"], request.match_info["pod"]
        pod = node.pod(ns, name)
        if pod is None:
            return aiohttp.web.Response(status=404, text=f'pod "{name}" not found on this node')
        try:
            return await serve_logs(
                request,
                pod,
                request.match_info["container"],
                node,
                lambda: request.transport is None,
            )
        except ApiError as exc:
            return aiohttp.web.Response(status=exc.code, text=exc.message)

    async def port_forward(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        ns, name = request.match_info["namespace"], request.match_info["pod"]
        pod = node.pod(ns, name)
        ip = ((pod or {}).get("status") or {}).get("podIP")
        if pod is None or not ip:
            return aiohttp.web.Response(
                status=404, text=f'pod "{name}" has no address on this node'
            )
        return await portforward.serve_upgraded(request, str(ip))

    async def refused(request: aiohttp.web.Request) -> aiohttp.web.Response:
        verb = request.match_info["verb"]
        return aiohttp.web.Response(status=400, text=NO_EXEC.format(verb=verb))

    async def healthz(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(text="ok")

    app = aiohttp.web.Application()
    app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", container_logs)
    app.router.add_route("*", "/portForward/{namespace}/{pod}", port_forward)
    app.router.add_route("*", "/{verb:exec|attach|run}/{rest:.*}", refused)
    app.router.add_get("/healthz", healthz)
    return app


async def serve(node: PodLogs, host: str, tls: ssl.SSLContext) -> tuple[aiohttp.web.AppRunner, int]:
    """Start the kubelet API on a free port of `host`; (runner to clean up, port)."""
    runner = aiohttp.web.AppRunner(make_app(node), handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, host, 0, ssl_context=tls)
    await site.start()
    return runner, int(runner.addresses[0][1])
