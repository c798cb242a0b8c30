"""`kvfleet demo` (`make demo`): the autoscaler at work on the local cluster.

The local cluster (the real Kubernetes control plane built from its Go modules; two nodes
whose agents run pods as processes on 127.x, no GPU), the real operator logged in with the
cluster's kubeconfig as a user's would be, and one autoscaled InferenceService with a warm
pool: 1..3 replicas in all, one a warm spare while fewer than 3 are active (warm replicas
count inside maxReplicas), scaled on
queue depth read from a real Prometheus (when installed: the PodMonitors the operator renders
become its scrape targets) or from the pods directly. Budgets live in Redis (examples/redis.yaml,
run as this machine's redis-server) when it is installed. Three tenants send bursty traffic
through the gateway with the OpenAI SDK — a support chat (multi-turn conversations sharing a
system prompt), a document search (one long shared prompt) and a trial tenant whose small
token budget runs out — steady, then a burst that climbs to its peak, then quiet.

Live: replicas by role with their queue, KV and tokens/s; each tenant's TTFT, tokens/s and
429s by reason; each scaling decision as it happens. At the end: `summary.json` and
`timeline.png` in the output directory, and exit 0 only if requests were served, a warm
replica was promoted, the fleet scaled up and back down, and the budget held; it reports
whether the replicas the burst asked for were ready before its traffic peaked.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import shutil
import sys
import threading
import time
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import yaml

from kvfleet_bench.demo.cluster_view import (
    BURST,
    NAME,
    NS,
    LiveTables,
    PlainLines,
    Progress,
    View,
    burst_share,
    on_a_terminal,
    peak_at,
    phase,
    refresh,
)
from kvfleet_bench.demo.live import live_view
from kvfleet_bench.demo.timeline import Run, Sample, TenantStats, summary, write_report
from kvfleet_gateway.keys import hash_key
from kvfleet_localcluster.files import replace_file
from kvfleet_localcluster.kubeapi import KubeClient
from kvfleet_localcluster.kubelet import KubeletConfig, cancel_and_wait
from kvfleet_localcluster.local import LocalCluster, LocalClusterConfig
from kvfleet_localcluster.node_agent import NodeSpec
from kvfleet_localcluster.podmonitors import PodMonitorTargets
from kvfleet_operator.handlers import Controller, OperatorConfig, run
from kvfleet_operator.kube import Kube
from kvfleet_operator.login import Credentials, api_client
from kvfleet_operator.scaling.autoscaler import AutoscalerConfig
from kvfleet_sim.fleet.collector import percentile
from kvfleet_sim.procs import free_port, running_process

MODEL = "llama-3.1-8b"
ROOT = Path(__file__).resolve().parents[3]
SUPPORT = "You are the support assistant of a GPU cloud. Answer briefly; cite the runbook. " * 6
SEARCH = "Answer from these documents only. " + "kv cache radix prefix replica queue " * 60
WORDS = "kv cache prefix replica queue token budget latency router tenant gpu batch".split()
NODES = (NodeSpec("h100-1"), NodeSpec("h100-2"))
"""The demo's cluster: two nodes of 8 H100s, room for its 3 replicas, Redis and the gateway
(every node costs a Lease renewal and a watch; nothing here needs more)."""


@dataclass(frozen=True)
class DemoConfig:
    duration_s: float = 120.0
    """Seconds of traffic: 20% steady, 35% burst (climbing to its peak over the first half),
    45% quiet (the fleet scales back)."""
    out: Path = Path("kvfleet-demo")
    cold_start_s: float = 6.0
    """How long a new engine pod loads its model here (a real 8B: minutes)."""
    scale_down_s: float = 15.0
    """The autoscaler's scale-down stabilization window."""
    seed: int = 7

    def __post_init__(self) -> None:
        # Everything under `out` is handed to other processes (Prometheus' file_sd, pods'
        # volumes, kubectl's kubeconfig), each with its own idea of a relative path's base.
        object.__setattr__(self, "out", self.out.resolve())


def quick_config(out: Path) -> DemoConfig:
    """The shortened run a test makes: every check still has to hold."""
    return DemoConfig(duration_s=30.0, out=out, cold_start_s=2.0, scale_down_s=5.0)


@dataclass(frozen=True)
class Tenant:
    name: str
    rates: tuple[float, float, float]
    """Requests/s in the steady, burst and quiet phases."""
    max_tokens: int
    budget: int | None = None


def tenants(config: DemoConfig) -> list[Tenant]:
    # ~220 tokens billed per trial request, ~0.45 requests/s on average over the run
    # (0.2/s steady, up to 1.5/s in the burst): the budget covers about a third of what it
    # asks for, so it runs out on the burst's ramp. (At 60 tokens/s of the run, the 30 s run
    # failed its check when 8 or fewer of its ~13 expected requests came: 8% of runs.)
    trial_budget = int(30 * config.duration_s)
    return [
        Tenant("support-chat", (0.5, 5.0, 0.2), 96),
        Tenant("doc-search", (0.25, 3.0, 0.1), 48),
        Tenant("trial", (0.2, 1.5, 0.0), 64, budget=trial_budget),
    ]


def objects(config: DemoConfig, keys: dict[str, str], store: str | None) -> list[dict[str, Any]]:
    key_file = {
        "tenants": [
            {
                "name": t.name,
                "keys": [hash_key(keys[t.name])],
                **(
                    {"limits": {"tokenBudget": {"tokens": t.budget, "period": "1d"}}}
                    if t.budget
                    else {}
                ),
            }
            for t in tenants(config)
        ]
    }
    gateway: dict[str, Any] = {
        "apiKeysSecret": "demo-keys",
        "defaultLimits": {"maxTokens": 256, "requestsPerMinute": 6000},
    }
    if store:
        gateway["limitsStore"] = store
    isvc = {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "model": {"name": MODEL, "source": {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"}},
            "engine": {"gpuType": "h100", "contextLength": 8192, "maxRunningRequests": 4},
            "autoscaling": {
                "minReplicas": 1,
                "maxReplicas": 3,
                "warmReplicas": 1,
                "targetQueueDepth": 2,
                "scaleUpStabilizationSeconds": 0,
                "scaleDownStabilizationSeconds": int(config.scale_down_s),
                "coldStartSeconds": int(config.cold_start_s),
            },
            "gateway": gateway,
            "cost": {"gpuHourlyPrice": 2.49},
        },
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "demo-keys", "namespace": NS},
        "stringData": {"keys.yaml": yaml.safe_dump(key_file)},
    }
    return [secret, isvc]


def _path(obj: dict[str, Any]) -> str:
    """The collection to POST a namespaced object to (the kinds this demo creates)."""
    group_version, kind = obj["apiVersion"], obj["kind"]
    base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    plural = {"StatefulSet": "statefulsets", "InferenceService": "inferenceservices"}.get(
        kind, kind.lower() + "s"
    )
    return f"{base}/namespaces/{obj['metadata']['namespace']}/{plural}"


# ---- the run --------------------------------------------------------------------------------
async def _create(api: aiohttp.ClientSession, url: str, obj: dict[str, Any]) -> None:
    async with api.post(url + _path(obj), json=obj) as r:
        if r.status not in (201, 409):
            raise RuntimeError(
                f"creating {obj['kind']} {obj['metadata']['name']}: {await r.text()}"
            )


def _start_prometheus(stack: ExitStack, work: Path, sd_file: Path) -> str | None:
    binary = shutil.which("prometheus")
    if binary is None:
        return None
    port = free_port()
    cfg = work / "prometheus.yml"
    scrape = {"job_name": "podmonitors", "file_sd_configs": [{"files": [str(sd_file)]}]}
    cfg.write_text(
        yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": [scrape]})
    )
    url = f"http://127.0.0.1:{port}"
    stack.enter_context(
        running_process(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            ready_url=f"{url}/-/ready",
            log_path=work / "prometheus.log",
        )
    )  # fmt: skip
    return url


async def _scenario(
    cluster: LocalCluster, config: DemoConfig, prometheus: str | None, live: Progress
) -> tuple[Run, dict[str, TenantStats], str]:
    rng = random.Random(config.seed)
    keys = {t.name: "kvf-" + secrets.token_urlsafe(16) for t in tenants(config)}
    stats = {t.name: TenantStats(budget=t.budget) for t in tenants(config)}
    burst = (BURST[0] * config.duration_s, BURST[1] * config.duration_s)
    run_ = Run(min_replicas=1, burst=burst, peak_at=peak_at(config.duration_s))
    view = View()
    src = f"Prometheus ({prometheus})" if prometheus else "the pods' /metrics (no Prometheus)"
    scrape_timeout = aiohttp.ClientTimeout(total=1.0)
    async with (
        cluster.session() as api,
        aiohttp.ClientSession(timeout=scrape_timeout) as scraper,
    ):
        url = cluster.url  # the CRDs and namespace NS: installed by the cluster at start
        store = None
        if shutil.which("redis-server"):
            for doc in yaml.safe_load_all((ROOT / "examples" / "redis.yaml").read_text()):
                if doc:
                    await _create(api, url, doc)
            store = f"redis://redis.{NS}.svc:6379/0"
        operator = _start_operator(cluster, prometheus)
        try:
            # (In a thread: the node agents running its pods share this loop.)
            await asyncio.to_thread(operator.ready.wait, 20)
            for obj in objects(config, keys, store):
                await _create(api, url, obj)
            # The operator, the kubelet and (cold) engine start-up at work.
            while not (view.gateway_url() and view.count("active") and view.count("warm")):
                await refresh(view, api, scraper, url, run_, 0.0)
                live.show(view, stats, run_, 0.0, src)
                await asyncio.sleep(0.5)
            if prometheus:
                await require_scraped_targets(scraper, prometheus, view.count("active"))
            gateway = view.gateway_url()
            clients = {
                name: openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0)
                for name, key in keys.items()
            }
            try:
                await _traffic(
                    config, view, api, scraper, url, run_, stats, clients, rng, live, src
                )
            finally:
                for c in clients.values():
                    await c.close()
        finally:
            await asyncio.to_thread(operator.close)
    return run_, stats, src


class SignalsUnavailable(RuntimeError):
    """The autoscaler could not see its signals: the demo would only show it holding."""


async def require_scraped_targets(
    scraper: aiohttp.ClientSession, prometheus: str, engines: int, within_s: float = 20.0
) -> None:
    """Fail at once, plainly, when Prometheus scrapes none of the ready engines — instead of
    two minutes of traffic with the autoscaler holding on "no fresh metrics"."""
    deadline = time.monotonic() + within_s
    up: list[str] = []
    active: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            async with scraper.get(f"{prometheus}/api/v1/targets?state=active") as r:
                active = (await r.json())["data"]["activeTargets"]
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
            active = []
        up = [t["scrapeUrl"] for t in active if t.get("health") == "up"]
        if len(up) >= engines:
            return
        await asyncio.sleep(0.5)
    raise SignalsUnavailable(
        f"Prometheus ({prometheus}) has {len(active)} active targets for the PodMonitors "
        f"({len(up)} up) {within_s:.0f} s after {engines} engine pod(s) became Ready: the "
        "autoscaler would see no fresh metrics. See prometheus.log and targets.json in the "
        "demo's cluster/ folder."
    )


async def _traffic(
    config: DemoConfig,
    view: View,
    api: aiohttp.ClientSession,
    scraper: aiohttp.ClientSession,
    url: str,
    run_: Run,
    stats: dict[str, TenantStats],
    clients: dict[str, openai.AsyncOpenAI],
    rng: random.Random,
    live: Progress,
    src: str,
) -> None:
    from kvfleet_bench.demo.traffic import Conversations, drive, one_request

    start = time.monotonic()

    def elapsed() -> float:
        return time.monotonic() - start

    chats = Conversations(SUPPORT, rng, WORDS)
    inflight: set[asyncio.Task[Any]] = set()
    by_name = {t.name: t for t in tenants(config)}

    async def support() -> None:
        i, messages = chats.next()
        reply = await one_request(
            clients["support-chat"], MODEL, messages, 96, stats["support-chat"]
        )
        if reply is not None:
            chats.answered(i, messages, reply)

    def question(system: str) -> list[dict[str, str]]:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15)))
        return [{"role": "system", "content": system}, {"role": "user", "content": words}]

    async def search() -> None:
        await one_request(clients["doc-search"], MODEL, question(SEARCH), 48, stats["doc-search"])

    async def trial() -> None:
        await one_request(clients["trial"], MODEL, question(SUPPORT), 64, stats["trial"])

    def rate(name: str) -> Any:
        def at(t: float) -> float:
            steady, burst, quiet = by_name[name].rates
            if phase(t, config.duration_s) == 2:
                return quiet
            return steady + (burst - steady) * burst_share(t, config.duration_s)

        return at

    # Each tenant draws its arrivals from a generator of its own: how the three interleave
    # (which depends on the machine's speed) does not change any tenant's traffic.
    sends = (("support-chat", support), ("doc-search", search), ("trial", trial))
    own = {n: random.Random(rng.random()) for n, _ in sends}
    peak = {n: max(by_name[n].rates) for n, _ in sends}
    drivers = [
        asyncio.create_task(
            drive(rate(n), peak[n], send, elapsed, config.duration_s, own[n], inflight)
        )
        for n, send in sends
    ]
    # After the traffic: at most one more stabilization window for the scale-down.
    end = config.duration_s + config.scale_down_s + 10
    while (t := elapsed()) < end:
        await refresh(view, api, scraper, url, run_, t)
        auto = (view.isvc.get("status") or {}).get("autoscaling") or {}
        desired = auto.get("desiredActive")
        run_.max_desired = max(run_.max_desired, desired or 0)
        run_.final_desired = desired
        now = time.monotonic()
        ttft = [v for s in stats.values() for v in s.window_ttft(now, 10.0)]
        run_.samples.append(
            Sample(
                round(t, 2),
                view.count("active"),
                view.count("warm"),
                desired,
                sum(m.get("queue", 0.0) for m in view.engine_metrics.values()),
                percentile(ttft, 50) if ttft else None,
                percentile(ttft, 99) if ttft else None,
                sum(s.tokens_per_s(now, 10.0) for s in stats.values()),
                sum(s.ok for s in stats.values()),
                sum(sum(s.refused.values()) for s in stats.values()),
            )
        )
        live.show(view, stats, run_, t, src)
        if t > config.duration_s and desired is not None and desired <= run_.min_replicas:
            break
        await asyncio.sleep(1.0)
    await asyncio.gather(*drivers)
    await asyncio.gather(*list(inflight))


class _Operator:
    def __init__(self, controller: Controller) -> None:
        self.stop, self.ready = threading.Event(), threading.Event()
        self.thread = threading.Thread(
            target=run,
            args=(controller,),
            kwargs={"stop_flag": self.stop, "ready_flag": self.ready},
            daemon=True,
        )
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(20)


def _start_operator(cluster: LocalCluster, prometheus: str | None) -> _Operator:
    credentials = Credentials(kubeconfig=str(cluster.kubeconfig))
    # Prometheus scrapes every second here: a 10 s rate window is four-plus scrapes, and lets
    # the fleet see a burst end within the demo's quiet phase.
    autoscaler = AutoscalerConfig(
        prometheus_url=prometheus, interval_s=1.0, stale_s=5.0, prometheus_rate_window="10s"
    )
    config = OperatorConfig(credentials=credentials, resync_s=10, autoscaler=autoscaler)
    return _Operator(Controller(Kube(api_client(credentials)), config))


def cluster_config(config: DemoConfig) -> LocalClusterConfig:
    """The demo's local cluster: its CRDs and namespace installed at start (ready means a
    pod can be created there), no LeaderWorkerSet controller (a single-node service)."""
    work = config.out / "cluster"
    return LocalClusterConfig(
        kubeconfig=config.out / "kubeconfig",
        namespace=NS,
        crds_dir=ROOT / "crds",
        lws=False,
        nodes=NODES,
        kubelet=KubeletConfig(
            state_dir=work / "state", time_scale=0.1, engine_startup_delay_s=config.cold_start_s
        ),
    )


async def _watch_podmonitors(astack: AsyncExitStack, cluster: LocalCluster, sd_file: Path) -> None:
    """The Prometheus Operator's part: the PodMonitors' pods, watched through the API,
    become Prometheus's file_sd targets."""
    replace_file(sd_file, "[]")  # Prometheus starts on an empty file, not a missing one
    client = KubeClient(
        cluster.url, cluster.ca_pem, "kvfleet-demo/podmonitors", cluster.admin_token
    )
    astack.push_async_callback(client.close)
    task = asyncio.create_task(PodMonitorTargets(client, sd_file).run())
    astack.push_async_callback(cancel_and_wait, task)


async def _cluster_facts(cluster: LocalCluster, ready_s: float) -> dict[str, Any]:
    """What the demo ran on, as the API server itself reports it (its /version)."""
    async with cluster.session() as api, api.get(f"{cluster.url}/version") as r:
        version = await r.json()
    return {
        "kubernetes": f"Kubernetes {version['gitVersion']}",
        "nodes": [f"{n.name}: {n.gpus}× {n.gpu_product}" for n in NODES],
        "ready_s": round(ready_s, 1),
    }


async def _run(config: DemoConfig) -> dict[str, Any]:
    work = config.out / "cluster"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()
    async with LocalCluster(cluster_config(config)) as cluster, AsyncExitStack() as astack:
        ran_on = await _cluster_facts(cluster, time.monotonic() - started)
        print(f"local cluster: {ran_on['kubernetes']}, ready in {ran_on['ready_s']} s",
              file=sys.stderr)  # fmt: skip
        stack = astack.enter_context(ExitStack())
        prometheus = None
        if shutil.which("prometheus"):
            sd_file = work / "targets.json"
            await _watch_podmonitors(astack, cluster, sd_file)
            prometheus = _start_prometheus(stack, work, sd_file)
        if on_a_terminal():
            with live_view() as live:
                tables = LiveTables(live, config.duration_s)
                run_, stats, src = await _scenario(cluster, config, prometheus, tables)
        else:
            lines = PlainLines(config.duration_s)
            run_, stats, src = await _scenario(cluster, config, prometheus, lines)
    doc = summary(run_, stats, src)
    doc["cluster"] = ran_on
    doc["report"] = [str(p) for p in write_report(config.out, doc, run_)]
    return doc


def run_autoscaler_demo(config: DemoConfig) -> dict[str, Any]:
    for noisy in ("kopf", "kvfleet", "httpx", "openai"):
        logging.getLogger(noisy).setLevel(logging.ERROR)  # the table tells the story
    return asyncio.run(_run(config))
