"""`kvfleet bench cluster`: the local cluster's API server and the operator at scale.

Each part runs its own `kvfleet cluster up` (the real control plane: kube-apiserver, etcd, the
controller manager and the scheduler built from their Go modules; node agents whose pods turn
Ready without processes; ten nodes of 100 H100s, so the real scheduler places every engine).

1. **API throughput** — kube-apiserver (TLS, token auth, RBAC) serves GETs of one object from
   16 keep-alive clients; the baseline, in the same run, is a bare aiohttp server on the same
   TLS answering the same path with a fixed body: the ceiling of a Python HTTP stack on this
   machine. Requests/s, latency and requests per CPU-second of the server process (all its
   threads), over 3 runs with the spread.
2. **1,000 InferenceServices** applied at once with `kubectl apply -f` (gateway disabled, no
   pod processes) while the operator runs in its own process under its ServiceAccount (a
   token from the TokenRequest API, the ClusterRole of manifests/base/rbac.yaml): time until all
   are Ready, the API server's request rate and latency (its /metrics) over that time, then
   the operator's requests in a steady window (all Ready, resync every 20 s), per service and
   hour. The operator's requests are counted by the API server itself: FlowSchemas of its
   Priority and Fairness (`OPERATOR_FLOWS`) classify them by verb, and its
   `apiserver_flowcontrol_dispatched_requests_total` counts each flow.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvfleet_bench.cluster_up import Kubectl, admin_headers, local_cluster
from kvfleet_bench.common import cpu_seconds
from kvfleet_sim.fleet.collector import percentile
from kvfleet_sim.procs import free_port, running_process

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_NAMESPACE, OPERATOR_ACCOUNT = "kvfleet-system", "kvfleet-operator"
WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")
OPERATOR_FLOWS = {
    "kvfleet-bench-operator-writes": list(WRITE_VERBS),
    "kvfleet-bench-operator-reads": ["get", "list"],
    "kvfleet-bench-operator-watches": ["watch"],
}
"""FlowSchemas that single out the operator's requests by verb (ahead of the built-in
`service-accounts` schema); the API server's flow-control metrics then count each."""
OPERATOR_DEFAULT_RESYNC_S = 60.0
"""`kvfleet operator --resync`'s default (OperatorConfig.resync_s)."""
RESYNC_SERVICES, RESYNC_S = 100, 1.0
"""The acceptance run: 100 services resynced every second (60 per minute: an hour's worth)."""
CLIENTS = 16


@dataclass(frozen=True)
class Throughput:
    rps: float
    p50_ms: float
    p99_ms: float
    per_cpu_s: float
    """Requests served per CPU-second of the server process."""


async def _hammer(
    url: str, headers: dict[str, str], seconds: float, ctx: ssl.SSLContext
) -> list[float]:
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def client(s: aiohttp.ClientSession) -> None:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            async with s.get(url, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"GET {url}: {r.status}")
            latencies.append(time.perf_counter() - t0)

    connector = aiohttp.TCPConnector(limit=0, ssl=ctx)
    async with aiohttp.ClientSession(connector=connector) as s:
        await asyncio.gather(*(client(s) for _ in range(CLIENTS)))
    return latencies


def _measure(
    url: str, headers: dict[str, str], pid: int, seconds: float, ctx: ssl.SSLContext
) -> Throughput:
    asyncio.run(_hammer(url, headers, 0.5, ctx))  # warm up: connections, caches
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    lat = asyncio.run(_hammer(url, headers, seconds, ctx))
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    return Throughput(
        len(lat) / wall,
        percentile(lat, 50) * 1000,
        percentile(lat, 99) * 1000,
        len(lat) / max(cpu, 1e-9),
    )


BASELINE_SERVER = """
import json, ssl, sys
from aiohttp import web
port, cert, key = int(sys.argv[1]), sys.argv[2], sys.argv[3]
body = json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}).encode()
async def handle(request):
    return web.Response(body=body, content_type="application/json")
app = web.Application()
app.router.add_get("/{tail:.*}", handle)
ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
ctx.load_cert_chain(cert, key)
web.run_app(app, host="127.0.0.1", port=port, ssl_context=ctx, print=None, access_log=None)
"""


def throughput_runs(
    work: Path, runs: int, seconds: float, say: Callable[[str], None]
) -> dict[str, list[Throughput]]:
    out: dict[str, list[Throughput]] = {"apiserver": [], "baseline": []}
    for i in range(runs):
        run_dir = work / f"throughput-{i}"
        run_dir.mkdir()
        # No node is needed to serve a ConfigMap: one, with no GPU, keeps the cluster small.
        with local_cluster(run_dir, crds=False, nodes=("cpu-1:0",)) as cluster:
            base = cluster.url
            headers, ctx = admin_headers(run_dir / "kubeconfig")
            cm = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "x"},
                "data": {"a": "b"},
            }
            asyncio.run(_post(f"{base}/api/v1/namespaces/default/configmaps", cm, headers, ctx))
            url = f"{base}/api/v1/namespaces/default/configmaps/x"
            api = _measure(url, headers, cluster.apiserver_pid, seconds, ctx)
            pki = cluster.pki
            bport = free_port()
            with running_process(
                [
                    sys.executable,
                    "-c",
                    BASELINE_SERVER,
                    str(bport),
                    str(pki / "apiserver.crt"),
                    str(pki / "apiserver.key"),
                ],
                log_path=run_dir / "baseline.log",
            ) as bproc:
                _wait_tls(f"https://127.0.0.1:{bport}/x", ctx)
                baseline = _measure(
                    f"https://127.0.0.1:{bport}/api/v1/namespaces/default/configmaps/x",
                    {},
                    bproc.pid,
                    seconds,
                    ctx,
                )
        out["apiserver"].append(api)
        out["baseline"].append(baseline)
        say(f"run {i + 1}: API server {api.rps:,.0f} req/s ({api.per_cpu_s:,.0f} per CPU-s, p99 "
            f"{api.p99_ms:.1f} ms); bare aiohttp+TLS {baseline.rps:,.0f} req/s")  # fmt: skip
    return out


def _wait_tls(url: str, ctx: ssl.SSLContext, timeout: float = 20.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(url)


# ---- 1,000 InferenceServices -----------------------------------------------------------------
@dataclass(frozen=True)
class ScaleRun:
    services: int
    apply_s: float
    """`kubectl apply -f` of all of them."""
    ready_s: float
    """From the apply's start until every one reports Ready=True."""
    requests: int
    """API requests served in that time (watches excluded)."""
    p50_ms: float
    p99_ms: float
    """Latency percentiles, as the upper bound of the histogram bucket they fall in."""
    operator_requests: int
    """Of `requests`, the operator's (its FlowSchemas at the API server)."""
    steady_window_s: float
    steady_operator_requests: int
    """The operator's requests (watches excluded) in the steady window."""
    resync_s: float = 20.0
    gateways: int = 0
    """Services with a gateway (Secret, ConfigMap, RBAC, gateway Deployment and Service...)."""
    steady_operator_writes: int = 0
    """Of those, writes: POST, PUT, PATCH, DELETE."""
    steady_events: int = 0
    """Events created in the services' namespace in the steady window."""

    @property
    def resyncs(self) -> float:
        return self.steady_window_s / self.resync_s

    @property
    def rps(self) -> float:
        return self.requests / self.ready_s

    @property
    def per_service_hour(self) -> float:
        return self.steady_operator_requests / self.services / (self.steady_window_s / 3600)


def _isvc(i: int, gateway: bool = False) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": f"svc-{i:04d}", "namespace": "scale"},
        "spec": {
            "model": {
                "name": "llama-3.1-8b",
                "source": {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"},
            },
            "engine": {"gpuType": "h100"},
            "replicas": 1,
            "gateway": {"insecureNoAuth": True} if gateway else {"enabled": False},
        },
    }


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def _requests(samples: list[tuple[str, dict[str, str], float]]) -> float:
    """Every client's API requests, watches excluded."""
    return sum(
        v for n, lab, v in samples if n == "apiserver_request_total" and lab["verb"] != "WATCH"
    )


def _operator_requests(
    samples: list[tuple[str, dict[str, str], float]], writes_only: bool = False
) -> float:
    """The operator's requests (watches excluded), as the API server's flow control
    dispatched them through `OPERATOR_FLOWS`."""
    flows = {n for n, verbs in OPERATOR_FLOWS.items() if "watch" not in verbs}
    if writes_only:
        flows = {n for n in flows if OPERATOR_FLOWS[n] == list(WRITE_VERBS)}
    return sum(
        v
        for n, lab, v in samples
        if n == "apiserver_flowcontrol_dispatched_requests_total" and lab["flow_schema"] in flows
    )


def flow_schemas() -> list[dict[str, Any]]:
    """`OPERATOR_FLOWS` as FlowSchemas, at the priority level the operator's requests get
    anyway (the built-in `service-accounts` schema's `workload-low`)."""
    subject = {
        "kind": "ServiceAccount",
        "serviceAccount": {"name": OPERATOR_ACCOUNT, "namespace": OPERATOR_NAMESPACE},
    }

    def rule(verbs: list[str]) -> dict[str, Any]:
        everything = {"apiGroups": ["*"], "resources": ["*"], "namespaces": ["*"]}
        return {"verbs": verbs, **everything, "clusterScope": True}

    return [
        {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "FlowSchema",
            "metadata": {"name": name},
            "spec": {
                "priorityLevelConfiguration": {"name": "workload-low"},
                "matchingPrecedence": 500,
                "distinguisherMethod": {"type": "ByUser"},
                "rules": [{"subjects": [subject], "resourceRules": [rule(verbs)]}],
            },
        }
        for name, verbs in OPERATOR_FLOWS.items()
    ]


def _buckets(samples: list[tuple[str, dict[str, str], float]]) -> dict[float, float]:
    out: dict[float, float] = {}
    for n, lab, v in samples:
        if n == "apiserver_request_duration_seconds_bucket":
            le = float(lab["le"])
            out[le] = out.get(le, 0.0) + v
    return out


def _quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    delta = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = delta[-1][1] if delta else 0.0
    for le, cumulative in delta:
        if total and cumulative >= q * total:
            return le
    return float("inf")


def _operator_kubeconfig(kubectl: Kubectl, kubeconfig: Path, work: Path) -> Path:
    """The operator's RBAC as manifests/base installs it, the FlowSchemas that count its
    requests, and a kubeconfig with its ServiceAccount's token (TokenRequest)."""
    base = ROOT / "manifests" / "base"
    kubectl("apply", "-f", str(base / "namespace.yaml"))
    kubectl("apply", "-f", str(base / "rbac.yaml"), "-n", OPERATOR_NAMESPACE)
    kubectl("apply", "-f", "-", stdin="\n---\n".join(yaml.safe_dump(f) for f in flow_schemas()))
    kubectl("create", "namespace", "scale")
    token = kubectl(
        "create", "token", OPERATOR_ACCOUNT, "-n", OPERATOR_NAMESPACE, "--duration=24h"
    ).strip()
    doc = yaml.safe_load(kubeconfig.read_text())
    doc["users"][0]["user"] = {"token": token}
    path = work / "operator-kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return path


def _wait_ready(
    base: str,
    headers: dict[str, str],
    ctx: ssl.SSLContext,
    services: int,
    operator: subprocess.Popen[bytes],
    log: Path,
) -> None:
    t0, ready = time.perf_counter(), 0
    url = f"{base}/apis/kvfleet.dev/v1alpha1/namespaces/scale/inferenceservices"
    while ready < services:
        if operator.poll() is not None:  # no point waiting the 900 s out
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
            raise RuntimeError(f"the operator exited ({operator.returncode}):\n{tail}")
        if time.perf_counter() - t0 > 900:
            raise RuntimeError(f"only {ready}/{services} Ready after 900s")
        time.sleep(1.0)
        listing = json.loads(asyncio.run(_get_text(url, headers, ctx)))
        ready = sum(
            any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in (o.get("status") or {}).get("conditions") or [])
            for o in listing["items"]
        )  # fmt: skip


def scale_run(
    work: Path,
    services: int,
    steady_s: float,
    say: Callable[[str], None],
    resync_s: float = 20.0,
    gateways: int = 0,
) -> ScaleRun:
    """`services` InferenceServices (the first `gateways` with a gateway) applied at once,
    until all are Ready, then a steady window with the operator resyncing every `resync_s`."""
    kubeconfig = work / "kubeconfig"
    with local_cluster(work, crds=True) as cluster:
        base, kubectl = cluster.url, Kubectl(kubeconfig, work)
        headers, ctx = admin_headers(kubeconfig)

        def metrics() -> list[tuple[str, dict[str, str], float]]:
            return _samples(asyncio.run(_get_text(f"{base}/metrics", headers, ctx)))

        def events() -> int:
            url = f"{base}/api/v1/namespaces/scale/events"
            return len(json.loads(asyncio.run(_get_text(url, headers, ctx)))["items"])

        op_kubeconfig = _operator_kubeconfig(kubectl, kubeconfig, work)
        with running_process(
            [sys.executable, "-m", "kvfleet_cli", "operator", "--kubeconfig", str(op_kubeconfig),
             "--metrics-port", "0",  # the default 8081 may be another operator's on this host
             "--resync", f"{resync_s:g}", "--log-level", "warning"],
            log_path=work / "operator.log",
        ) as operator:  # fmt: skip
            time.sleep(3.0)  # kopf starts its watches
            docs = "\n---\n".join(yaml.safe_dump(_isvc(i, i < gateways)) for i in range(services))
            before = metrics()
            t0 = time.perf_counter()
            kubectl("apply", "-f", "-", stdin=docs)
            apply_s = time.perf_counter() - t0
            say(f"kubectl apply of {services} InferenceServices: {apply_s:.1f}s")
            _wait_ready(base, headers, ctx, services, operator, work / "operator.log")
            ready_s = time.perf_counter() - t0
            after = metrics()
            say(f"all {services} Ready {ready_s:.1f}s after the apply started")
            time.sleep(1.0)
            steady0, events0 = metrics(), events()
            time.sleep(steady_s)
            steady1, events1 = metrics(), events()
    b0, b1 = _buckets(before), _buckets(after)
    return ScaleRun(
        services=services,
        apply_s=apply_s,
        ready_s=ready_s,
        requests=int(_requests(after) - _requests(before)),
        operator_requests=int(_operator_requests(after) - _operator_requests(before)),
        p50_ms=_quantile(b0, b1, 0.5) * 1000,
        p99_ms=_quantile(b0, b1, 0.99) * 1000,
        steady_window_s=steady_s,
        steady_operator_requests=int(_operator_requests(steady1) - _operator_requests(steady0)),
        resync_s=resync_s,
        gateways=gateways,
        steady_operator_writes=int(
            _operator_requests(steady1, True) - _operator_requests(steady0, True)
        ),
        steady_events=events1 - events0,
    )


async def _get_text(url: str, headers: dict[str, str], ctx: ssl.SSLContext) -> str:
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s,
        s.get(url, headers=headers) as r,
    ):
        return await r.text()


async def _post(url: str, obj: Any, headers: dict[str, str], ctx: ssl.SSLContext) -> None:
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s,
        s.post(url, json=obj, headers=headers) as r,
    ):
        if r.status != 201:
            raise RuntimeError(f"POST {url}: {r.status} {await r.text()}")


# ---- report ------------------------------------------------------------------------------------
def run_cluster_bench(
    out_dir: Path,
    services: int,
    runs: int,
    seconds: float,
    steady_s: float,
    say: Callable[[str], None],
) -> tuple[dict[str, list[Throughput]], ScaleRun, ScaleRun]:
    with tempfile.TemporaryDirectory(prefix="kvfleet-cluster-bench-") as tmp:
        work = Path(tmp)
        tp = throughput_runs(work, runs, seconds, say)
        scale_dir, resync_dir = work / "scale", work / "resync"
        scale_dir.mkdir()
        resync_dir.mkdir()
        scale = scale_run(scale_dir, services, steady_s, say)
        say(f"{RESYNC_SERVICES} services, resync every {RESYNC_S:g} s for {steady_s:g} s")
        resync = scale_run(
            resync_dir, RESYNC_SERVICES, steady_s, say, RESYNC_S, RESYNC_SERVICES // 2
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    from kvfleet_bench.cluster_report import report

    (out_dir / "cluster.md").write_text(report(tp, scale, resync))
    return tp, scale, resync
