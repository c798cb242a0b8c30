"""`kvfleet demo --on-cluster`: the Kubernetes path, live, on the local cluster.

The local cluster (pods as processes on 127.0.0.x), the real operator, and an
InferenceService applied to it: the operator renders the engine Deployment and the gateway,
the kubelet runs them, the gateway discovers the engines through the API, and a tenant's
traffic flows through the gateway pod. Mid-run the service is scaled from 2 to 3 replicas
(as `kubectl scale kis` would) and an engine pod is deleted (self-healing). The table reads
the cluster (pods, the InferenceService's status, Events) and what the client saw.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from rich.console import Group
from rich.live import Live
from rich.table import Table

from kvfleet_bench.demo.stack import TenantStats, send_chat, support_body
from kvfleet_gateway.keys import hash_key
from kvfleet_localcluster.kubelet import KubeletConfig
from kvfleet_localcluster.local import LocalCluster, LocalClusterConfig
from kvfleet_operator.crd import crd
from kvfleet_operator.handlers import Controller, OperatorConfig, run
from kvfleet_operator.kube import Kube
from kvfleet_operator.login import Credentials, api_client
from kvfleet_operator.status import pod_ready
from kvfleet_sim.fleet.collector import percentile

NS, NAME, TENANT = "ai", "llama", "support-chat"
ISVC_PATH = f"/apis/kvfleet.dev/v1alpha1/namespaces/{NS}/inferenceservices"


def _objects(key_hash: str) -> list[tuple[str, dict[str, Any]]]:
    keys = {"tenants": [{"name": TENANT, "keys": [key_hash]}]}
    isvc = {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "model": {
                "name": "llama-3.1-8b",
                "source": {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"},
            },
            "engine": {"gpuType": "h100", "contextLength": 8192},
            "replicas": 2,
            "gateway": {"apiKeysSecret": "ai-api-keys", "defaultLimits": {"maxTokens": 512}},
            "cost": {"gpuHourlyPrice": 3.5},
        },
    }
    return [
        ("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd()),
        ("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}),
        (
            f"/api/v1/namespaces/{NS}/secrets",
            {
                "metadata": {"name": "ai-api-keys"},
                "stringData": {"keys.yaml": yaml.safe_dump(keys)},
            },
        ),
        (ISVC_PATH, isvc),
    ]


class ClusterView:
    """What the table shows, read from the API server."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url
        self.pods: list[dict[str, Any]] = []
        self.isvc: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []

    async def get(self, path: str) -> Any:
        async with self.session.get(self.url + path) as r:
            return await r.json()

    async def refresh(self) -> None:
        pods = await self.get(f"/api/v1/namespaces/{NS}/pods")
        self.pods = sorted(pods.get("items") or [], key=lambda p: p["metadata"]["name"])
        self.isvc = await self.get(f"{ISVC_PATH}/{NAME}")
        events = (await self.get(f"/api/v1/namespaces/{NS}/events")).get("items") or []
        self.events = sorted(events, key=lambda e: e["metadata"]["resourceVersion"].zfill(12))

    def gateway_ip(self) -> str | None:
        for p in self.pods:
            labels = p["metadata"].get("labels") or {}
            if labels.get("app.kubernetes.io/component") == "gateway" and pod_ready(p):
                return str(p["status"]["podIP"])
        return None


def _render(view: ClusterView, stats: TenantStats, elapsed: float, duration: float) -> Group:
    st = view.isvc.get("status") or {}
    ready: dict[str, Any] = next(
        (c for c in st.get("conditions") or [] if c["type"] == "Ready"), {}
    )
    head = Table(
        title=f"InferenceService {NS}/{NAME} · {elapsed:4.1f} of {duration:.0f} s", expand=True
    )
    for col in ("desired", "ready", "active", "Ready", "reason", "gateway"):
        head.add_column(col)
    head.add_row(
        str(st.get("desiredReplicas", "-")),
        str(st.get("readyReplicas", "-")),
        str(st.get("activeReplicas", "-")),
        ready.get("status", "-"),
        ready.get("reason", "-"),
        st.get("gatewayURL", "-"),
    )
    pods = Table(title="pods (each a local process on its own address)", expand=True)
    for col in ("pod", "IP", "role", "status", "restarts"):
        pods.add_column(col)
    for p in view.pods:
        cs = ((p.get("status") or {}).get("containerStatuses") or [{}])[0]
        labels = p["metadata"].get("labels") or {}
        role = labels.get("kvfleet.dev/role") or labels.get("app.kubernetes.io/component", "")
        pods.add_row(
            p["metadata"]["name"],
            (p.get("status") or {}).get("podIP", "-"),
            role,
            "Ready" if pod_ready(p) else "starting",
            str(cs.get("restartCount", 0)),
        )
    now = time.monotonic()
    recent = [v for at, v in stats.ttft if now - at <= 10]
    traffic = Table(title=f"tenant {TENANT} through the gateway pod", expand=True)
    for col in ("sent", "ok", "failed", "TTFT p50", "TTFT p99", "cache hits"):
        traffic.add_column(col, justify="right")
    traffic.add_row(
        str(stats.sent),
        str(stats.ok),
        str(sum(stats.rejected.values())),
        f"{percentile(recent, 50) * 1000:.0f} ms" if recent else "-",
        f"{percentile(recent, 99) * 1000:.0f} ms" if recent else "-",
        f"{stats.cached_tokens / stats.prompt_tokens:.0%}" if stats.prompt_tokens else "-",
    )
    events = Table(title="events", expand=True)
    for col in ("type", "reason", "message"):
        events.add_column(col)
    for e in view.events[-5:]:
        events.add_row(e.get("type", ""), e.get("reason", ""), e.get("message", "")[:110])
    return Group(head, pods, traffic, events)


async def _scenario(cluster: LocalCluster, key: str, duration: float) -> dict[str, Any]:
    rng = random.Random(5)
    stats = TenantStats()
    inflight: set[asyncio.Task[None]] = set()
    url = cluster.url
    async with (
        cluster.session() as api,  # the API server: TLS with the cluster CA, admin token
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
    ):
        view = ClusterView(api, url)
        for path, obj in _objects(hash_key(key)):
            async with api.post(url + path, json=obj) as r:
                assert r.status == 201, await r.text()
        with Live(refresh_per_second=4) as live:
            while view.gateway_ip() is None:  # the operator and the kubelet at work
                await view.refresh()
                live.update(_render(view, stats, 0.0, duration))
                await asyncio.sleep(0.25)
            gw = f"http://{view.gateway_ip()}:8080"
            start = time.monotonic()
            scaled = deleted = False
            while (elapsed := time.monotonic() - start) < duration:
                for _ in range(rng.randint(1, 4)):
                    task = asyncio.create_task(
                        send_chat(session, gw, key, support_body(rng), stats)
                    )
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
                if not scaled and elapsed > duration * 0.3:  # kubectl scale kis llama --replicas=3
                    scaled = True
                    async with api.patch(
                        f"{url}{ISVC_PATH}/{NAME}/scale",
                        json={"spec": {"replicas": 3}},
                        headers={"Content-Type": "application/merge-patch+json"},
                    ):
                        pass
                if not deleted and elapsed > duration * 0.6:  # a node loses a pod
                    deleted = True
                    victim = next(p for p in view.pods if "engine" in p["metadata"]["name"])
                    async with api.delete(
                        f"{url}/api/v1/namespaces/{NS}/pods/{victim['metadata']['name']}"
                    ):
                        pass
                await view.refresh()
                live.update(_render(view, stats, elapsed, duration))
                await asyncio.sleep(0.25)
            await asyncio.gather(*list(inflight))
            await view.refresh()
            live.update(_render(view, stats, duration, duration))
    ttft = [v for _, v in stats.ttft]
    return {
        "sent": stats.sent,
        "ok": stats.ok,
        "failed": stats.rejected,
        "ttft_p50_ms": percentile(ttft, 50) * 1000 if ttft else None,
        "ready_replicas": (view.isvc.get("status") or {}).get("readyReplicas"),
        "pods": [p["metadata"]["name"] for p in view.pods],
        "events": [e.get("reason") for e in view.events],
    }


async def _run(duration: float, work: Path) -> dict[str, Any]:
    config = LocalClusterConfig(
        kubeconfig=work / "kubeconfig",
        kubelet=KubeletConfig(state_dir=work / "state"),
        resync_s=0.5,
    )
    async with LocalCluster(config) as cluster:
        stop, ready = threading.Event(), threading.Event()
        credentials = Credentials(kubeconfig=str(cluster.kubeconfig))
        controller = Controller(
            Kube(api_client(credentials)), OperatorConfig(credentials=credentials, resync_s=10)
        )
        operator = threading.Thread(
            target=run,
            args=(controller,),
            daemon=True,
            kwargs={"stop_flag": stop, "ready_flag": ready},
        )
        operator.start()
        try:
            await asyncio.to_thread(ready.wait, 20)
            return await _scenario(cluster, "kvf-" + secrets.token_urlsafe(16), duration)
        finally:
            stop.set()
            await asyncio.to_thread(operator.join, 20)


def run_cluster_demo(duration: float, work: Path) -> dict[str, Any]:
    import logging

    logging.getLogger("kopf").setLevel(logging.ERROR)  # the table tells the story
    return asyncio.run(_run(duration, work))
