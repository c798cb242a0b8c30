"""The autoscaler on the local cluster, end to end: engine pods running as simulator
processes, the real operator reading their signals (directly, or from a real Prometheus),
load sent through the gateway pod. A warm spare is promoted in seconds, the fleet grows
and shrinks (the least busy replica demoted first; what runs on a demoted pod completes), the
gateway follows the roles, Prometheus going away holds the size, and an operator restart
neither flaps nor repeats events."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from kvfleet_localcluster.kubeapi import KubeClient
from kvfleet_localcluster.kubelet import cancel_and_wait
from kvfleet_localcluster.podmonitors import PodMonitorTargets
from kvfleet_operator.kube import DEPLOYMENT, ISVC, POD, Kube, Resource
from kvfleet_operator.login import Credentials, api_client
from kvfleet_operator.scaling.autoscaler import AutoscalerConfig
from kvfleet_sim.procs import free_port, running_process
from tests.conftest import require_binary
from tests.support.cluster import Env, OperatorThread, cluster_config
from tests.support.objects import NS, condition, isvc
from tests.support.shared_cluster import SERVICE_ACCOUNT, ClusterThread, WorkerClusters
from tests.support.waiting import until

EVENTS = Resource("v1", "Event", "events")
ENGINES = "kvfleet.dev/inferenceservice=llama,app.kubernetes.io/component=engine"
AUTOSCALING = {
    "minReplicas": 1,
    "maxReplicas": 3,
    "warmReplicas": 1,
    "targetQueueDepth": 2,
    "scaleUpStabilizationSeconds": 0,
    "scaleDownStabilizationSeconds": 6,
    "coldStartSeconds": 5,
}


# The Prometheus test scrapes every second: a 15 s rate() window holds fifteen samples (the
# default minute is sized for the usual 15-30 s scrape), and the scale-down waits that much.
RATE_WINDOW_S = 15


@dataclass
class Stack:
    env: Env
    operator: OperatorThread | None = None

    def start_operator(self, prometheus: str | None = None) -> OperatorThread:
        self.operator = OperatorThread(
            self.env.credentials,
            autoscaler=AutoscalerConfig(
                prometheus_url=prometheus,
                interval_s=1.0,
                stale_s=5.0,
                prometheus_rate_window=f"{RATE_WINDOW_S}s",
            ),
        )
        assert self.operator.ready.wait(15), "the operator did not start"
        return self.operator

    def pods(self) -> list[dict[str, Any]]:
        return self.env.kube.list(POD, NS, ENGINES)

    def roles(self) -> dict[str, str]:
        """Ready engine pods → role."""
        return {
            p["metadata"]["name"]: p["metadata"]["labels"].get("kvfleet.dev/role", "")
            for p in self.pods()
            if condition(p, "Ready").get("status") == "True"
        }

    def body(self) -> dict[str, Any]:
        return self.env.kube.get(ISVC, NS, "llama") or {}

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.env.kube.list(EVENTS, NS) if e["reason"] == reason]

    def gateway_url(self) -> str | None:
        for p in self.env.kube.list(POD, NS, "app.kubernetes.io/component=gateway"):
            if condition(p, "Ready").get("status") == "True":
                return f"http://{p['status']['podIP']}:8080"
        return None


@contextlib.asynccontextmanager
async def stack_on(cluster: ClusterThread) -> AsyncIterator[Stack]:
    """The service's namespace `NS` of `cluster`; the operator a test starts is stopped
    after it."""
    kubeconfig = cluster.namespace_kubeconfig(NS)
    kube = Kube(api_client(Credentials(kubeconfig=str(kubeconfig))))
    s = Stack(Env(cluster, NS, kubeconfig, kube))
    try:
        yield s
    finally:
        if s.operator is not None:
            await asyncio.to_thread(s.operator.close)


SHARED_KIND = "autoscaling"
"""The worker's cluster of the autoscaling tests: pods as processes, at 0.1 of a real
kubelet's timing."""
NAMESPACE = Resource("v1", "Namespace", "namespaces", namespaced=False)


def fresh_namespace(cluster: ClusterThread, name: str) -> None:
    """`name` created anew (the last test's deleted first), once its `default`
    ServiceAccount exists. The services' tests all use namespace `NS` and an operator
    watching the whole cluster, so they take the cluster one at a time."""
    admin, path = cluster.admin, NAMESPACE.path(None, name)
    deadline = time.monotonic() + 120
    while admin.get(NAMESPACE, None, name) is not None:
        with contextlib.suppress(Exception):
            admin.request("DELETE", path)
        assert time.monotonic() < deadline, f"namespace {name} still there after 120 s"
        time.sleep(0.2)
    admin.request("POST", NAMESPACE.path(None), {"metadata": {"name": name}})
    while admin.get(SERVICE_ACCOUNT, name, "default") is None:
        assert time.monotonic() < deadline, f"namespace {name}: no default ServiceAccount"
        time.sleep(0.05)


@pytest.fixture
async def stack(worker_clusters: WorkerClusters) -> AsyncIterator[Stack]:
    """Namespace `NS`, new, on the worker's autoscaling cluster (started by its first test;
    the timeout bounds the test, not the start), deleted after the test."""
    worker_clusters.configs.setdefault(
        SHARED_KIND, lambda tmp: cluster_config(tmp, namespace="default", run_processes=True,
                                                time_scale=0.1)
    )  # fmt: skip
    cluster = await asyncio.to_thread(worker_clusters.get, SHARED_KIND)
    await asyncio.to_thread(fresh_namespace, cluster, NS)
    try:
        async with stack_on(cluster) as s:
            yield s
    finally:
        await asyncio.to_thread(cluster.delete_namespace, NS)


@pytest.fixture
async def monitored_stack(tmp_path: Path) -> AsyncIterator[Stack]:
    """A cluster of the test's own with the Prometheus Operator's CRDs, namespace `NS`."""
    config = cluster_config(tmp_path, monitoring=True, run_processes=True, time_scale=0.1)
    cluster = await asyncio.to_thread(ClusterThread, config)
    try:
        async with stack_on(cluster) as s:
            yield s
    finally:
        await asyncio.to_thread(cluster.close)


def autoscaled(**engine: Any) -> dict[str, Any]:
    # Two running requests per replica: a queue forms at once under a burst.
    return isvc(
        "llama",
        engine={"gpuType": "h100", "maxRunningRequests": 2, **engine},
        autoscaling=AUTOSCALING,
    )


async def chat(
    session: aiohttp.ClientSession,
    url: str,
    max_tokens: int,
    ignore_eos: bool = False,
    prompt: str = "tell me about kvfleet",
) -> int:
    body = {
        "model": "llama-3.1-8b",
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "stream": True,
        "messages": [{"role": "user", "content": prompt}],
    }
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        async for _ in r.content:
            pass
        return r.status


async def burst(
    url: str,
    n: int,
    max_tokens: int,
    every_s: float = 0.0,
    ignore_eos: bool = False,
    distinct: bool = False,
) -> list[int]:
    """`n` streaming chats, one every `every_s` seconds; their HTTP statuses. With
    `ignore_eos` each runs to `max_tokens` (else the engine ends it where the text would);
    `distinct`: no two share a prompt prefix (the router spreads them by load alone)."""
    timeout = aiohttp.ClientTimeout(total=120)

    async def one(s: aiohttp.ClientSession, i: int) -> int:
        await asyncio.sleep(i * every_s)
        prompt = f"{i}: tell me about kvfleet" if distinct else "tell me about kvfleet"
        return await chat(s, url, max_tokens, ignore_eos, prompt)

    async with aiohttp.ClientSession(timeout=timeout) as s:
        return list(await asyncio.gather(*(one(s, i) for i in range(n))))


async def ready_service(stack: Stack) -> str:
    await asyncio.to_thread(stack.env.kube.create, autoscaled())
    await until(
        lambda: sorted(stack.roles().values()) == ["active", "warm"],
        30,
        "one active and one warm replica",
    )
    url = await until(stack.gateway_url, 30, "a ready gateway pod")
    await until(lambda: (stack.body().get("status") or {}).get("autoscaling"), 15, "a decision")
    return str(url)


async def engine_metric(pod_ip: str, name: str) -> float:
    """One engine pod's metric `name`, summed over its series."""
    async with aiohttp.ClientSession() as s, s.get(f"http://{pod_ip}:30000/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def served_requests(pod_ip: str) -> float:
    """Non-zero once the pod has prefilled (and sent the first token of) a request."""
    return await engine_metric(pod_ip, "sglang:prompt_tokens_total")


def live(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


async def scale_up_and_down(stack: Stack) -> None:
    """Up under a burst, down under a tail of three long requests that must outlast the
    demotion. Their three arrivals at once are demand the forecast must see fade, so the
    scale-down window starts over when they come (and read from Prometheus, the load's drop
    shows a scrape and a rate window later than scraped directly)."""
    t0 = time.monotonic()
    url = await ready_service(stack)
    print(f"service ready in {time.monotonic() - t0:.1f}s")
    last: list[dict[str, Any]] = []
    watch = asyncio.create_task(watch_demand(stack, last))
    pods = await asyncio.to_thread(stack.pods)
    warm = next(p for p in pods if p["metadata"]["labels"]["kvfleet.dev/role"] == "warm")
    warm_name, warm_ip = warm["metadata"]["name"], warm["status"]["podIP"]
    assert await served_requests(warm_ip) == 0  # a warm spare takes no traffic
    # A light load the one active replica keeps up with (one short request at a time): the
    # ticks the capacity estimate learns "served well" from, before the burst's failures.
    assert await burst(url, 8, 16, every_s=0.5) == [200] * 8
    started = time.monotonic()
    # ~3 requests/s of 300 tokens; one replica serves under one a second (2 at a time).
    load = asyncio.create_task(burst(url, 30, 300, every_s=0.3))
    # The warm spare is promoted first (seconds), then the Deployment grows to the maximum.
    await until(lambda: stack.roles().get(warm_name) == "active", 20, "the warm spare promoted")
    promoted_s = time.monotonic() - started
    await until(lambda: served_requests(warm_ip), 20, "the promoted pod serving", interval=0.1)
    serving_s = time.monotonic() - started
    await until(
        lambda: (stack.env.kube.get(DEPLOYMENT, NS, "llama-engine") or {})["spec"]["replicas"] == 3,
        20,
        "the engine Deployment at its maximum",
    )
    scaled_s = time.monotonic() - started
    # Three long requests (distinct prompts: spread by load) as the load's last requests go
    # out: 3 running of 2 slots each is load for 2 replicas (at the 0.85 target), so once the
    # load has drained (10-20 s) the least busy replica is demoted; whatever runs on it
    # completes (2,400 tokens: ~25 s), and a pod goes only once idle.
    await asyncio.sleep(max(0.0, started + 30 * 0.3 - time.monotonic()))
    down = time.monotonic()
    tail = asyncio.create_task(burst(url, 3, 2400, ignore_eos=True, distinct=True))
    statuses = await load
    assert statuses == [200] * 30, statuses
    body = await asyncio.to_thread(stack.body)
    auto = body["status"]["autoscaling"]
    assert auto["source"] in ("direct", "prometheus") and "coldStartSeconds" in auto
    assert body["status"]["metrics"]["kvCacheUsage"] >= 0
    if auto["source"] == "direct":  # the gateways' lifetime counters (Prometheus: a 5m rate)
        await until(
            lambda: "costPer1kTokens" in (stack.body()["status"].get("metrics") or {}),
            10,
            "the cost per 1k tokens in the status",
        )
    assert await asyncio.to_thread(stack.events, "ScaledUp"), "no ScaledUp event"
    print(
        f"warm spare promoted {promoted_s:.1f}s and serving {serving_s:.1f}s after the burst "
        f"began; Deployment at max after {scaled_s:.1f}s"
    )
    roles = await until(
        lambda: (r := stack.roles()) and list(r.values()).count("active") == 2 and r,
        30,
        "demotion to 2 active",
    )
    assert not tail.done(), "the long requests ended before any demotion"
    # Which replica went: the least busy (the requests each runs, read from the engines; the
    # tail's are 25 s long, so they are what the operator saw a tick ago), the newest of equals.
    ready = [p for p in await asyncio.to_thread(stack.pods) if p["metadata"]["name"] in roles]
    running = {
        p["metadata"]["name"]: await engine_metric(p["status"]["podIP"], "sglang:num_running_reqs")
        for p in ready
    }
    demoted = next(name for name, role in roles.items() if role == "warm")
    print(
        f"one replica demoted {time.monotonic() - down:.1f}s after the tail began; requests "
        f"running: {running}, demoted {demoted}"
    )
    assert running[demoted] == min(running.values()), f"{demoted} was not the least busy"
    assert await tail == [200] * 3
    done = time.monotonic()
    print(f"the long requests done {done - down:.1f}s after they began")
    # The fleet is busy until the tail ends, and the tail's three arrivals stay in a Prometheus
    # rate() window that long after they came; then the down window (6 s) runs; 30 s on top
    # for ticks and scrapes.
    busy_until = max(done, down + RATE_WINDOW_S)
    settle_s = float(AUTOSCALING["scaleDownStabilizationSeconds"]) + 30
    try:
        await until(
            lambda: (
                sorted(stack.roles().values()) == ["active", "warm"]
                and len(live(stack.pods())) == 2
            ),
            busy_until + settle_s - time.monotonic(),
            "back to one active and one warm",
        )
    except BaseException:
        print_scaling(stack)  # what the operator decided, for the failure's report
        raise
    assert await asyncio.to_thread(stack.events, "ScaledDown"), "no ScaledDown event"
    # The operator's own resizes of the Deployment read as such, with the decision's reason;
    # nobody else touched it, so nothing reads as drift repaired.
    resized = await asyncio.to_thread(stack.events, "Scaled")
    assert any("Deployment/llama-engine 2 -> 3 replicas: " in e["message"] for e in resized)
    assert {e["type"] for e in resized} == {"Normal"}, resized
    assert await asyncio.to_thread(stack.events, "DriftRepaired") == []
    print(f"back to 1 active + 1 warm {time.monotonic() - done:.1f}s after the tail ended")
    await until(lambda: len(stack.pods()) == 2, 60, "the removed pods' processes gone")
    # Demand: the gateways' arrival rate, forecast a cold start ahead, and the capacity per
    # replica the fleet has shown, in the status (and `kvfleet describe`) at some point of
    # the run (when the capacity is first learned depends on which ticks the load fell in).
    try:
        demand = await asyncio.wait_for(watch, 30)
    except TimeoutError:
        pytest.fail(f"no demand forecast and capacity in status.autoscaling: last {last}")
    assert demand["capacityRequestsPerSecond"] > 0 and demand["boundBy"], demand
    assert 0 <= demand["forecastTrendWeight"] <= 1, demand
    # The gateway's roofline of a replica at the request mix, read through the same reader.
    assert demand["replicaThroughputRequestsPerSecond"] > 0, demand


def print_scaling(stack: Stack) -> None:
    """The fleet's roles, the last decision and the scaling Events, in order."""
    print("roles:", stack.roles())
    print("status.autoscaling:", (stack.body().get("status") or {}).get("autoscaling"))
    events = [e for e in stack.env.kube.list(EVENTS, NS) if e["reason"].startswith("Scaled")]
    for e in sorted(events, key=lambda e: e.get("lastTimestamp") or ""):
        print(e.get("lastTimestamp"), e["reason"], e.get("message"))


async def watch_demand(stack: Stack, seen: list[dict[str, Any]]) -> dict[str, Any]:
    """The first status.autoscaling with a demand forecast, a learned capacity and the
    gateways' roofline of a replica (every status read is kept in `seen`, for a failure's
    message)."""
    while True:
        a = (await asyncio.to_thread(stack.body)).get("status", {}).get("autoscaling") or {}
        seen[:] = [a]
        wanted = ("capacityRequestsPerSecond", "replicaThroughputRequestsPerSecond")
        if all(a.get(k) for k in wanted) and "forecastRequestsPerSecond" in a:
            return a
        await asyncio.sleep(0.2)


async def test_direct_scrape_scales_up_promotes_and_back(stack: Stack) -> None:
    await asyncio.to_thread(stack.start_operator)
    await scale_up_and_down(stack)
    body = await asyncio.to_thread(stack.body)
    assert body["status"]["autoscaling"]["source"] == "direct"
    assert condition(body, "ScalingActive")["status"] == "True"
    # The operator's metrics counted the moves (kvfleet_operator_scaling_decisions_total).
    assert stack.operator is not None
    decisions = stack.operator.controller.metrics.scaling_decisions
    assert decisions.labels(NS, "llama", "up")._value.get() >= 1
    assert decisions.labels(NS, "llama", "down")._value.get() >= 1


# ---- with a real Prometheus ---------------------------------------------------------------------
@pytest.fixture
def prometheus_sd(tmp_path: Path) -> Iterator[Any]:
    binary = require_binary("prometheus")
    with ExitStack() as stack:

        def start(sd_file: Path) -> tuple[str, Any]:
            port = free_port()
            cfg = tmp_path / "prometheus.yml"
            cfg.write_text(
                yaml.safe_dump(
                    {
                        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                        "scrape_configs": [
                            {
                                "job_name": "kvfleet",
                                "file_sd_configs": [
                                    {"files": [str(sd_file)], "refresh_interval": "1s"}
                                ],
                            }
                        ],
                    }
                )
            )
            url = f"http://127.0.0.1:{port}"
            proc = stack.enter_context(
                running_process(
                    [
                        binary,
                        f"--config.file={cfg}",
                        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{port}",
                    ],
                    ready_url=f"{url}/-/ready",
                    log_path=tmp_path / "prometheus.log",
                )
            )
            return url, proc

        yield start


# The whole story (up, down, a restart, Prometheus gone) takes ~60 s alone; each step keeps its
# own deadline, so the test's limit is only the backstop.
@pytest.mark.timeout(240)
async def test_prometheus_scales_holds_when_it_is_gone_and_survives_a_restart(
    monitored_stack: Stack, prometheus_sd: Any, tmp_path: Path
) -> None:
    # The Prometheus Operator's part, played by the local cluster: the PodMonitors the
    # operator renders (the Prometheus Operator's CRDs installed with the cluster) become
    # Prometheus's scrape targets, from watches of PodMonitors and pods.
    stack, cluster = monitored_stack, monitored_stack.env.cluster
    targets = tmp_path / "targets.json"
    client = KubeClient(cluster.url, cluster.ca_pem, "kvfleet-test", cluster.admin_token)
    syncer = asyncio.create_task(PodMonitorTargets(client, targets).run())
    try:
        await until(targets.exists, 30, "the PodMonitors' targets file")
        url, proc = prometheus_sd(targets)
        await asyncio.to_thread(stack.start_operator, url)
        await scale_up_and_down(stack)
        body = await asyncio.to_thread(stack.body)
        assert body["status"]["autoscaling"]["source"] == "prometheus"

        def counts() -> tuple[int, int]:
            return len(stack.events("ScaledUp")), len(stack.events("ScaledDown"))

        # An operator restart mid-run: same decision, no new event, no flapping.
        before = await asyncio.to_thread(counts)
        assert stack.operator is not None
        await asyncio.to_thread(stack.operator.close)
        await asyncio.to_thread(stack.start_operator, url)
        await asyncio.sleep(4)
        assert await asyncio.to_thread(counts) == before
        assert sorted((await asyncio.to_thread(stack.roles)).values()) == ["active", "warm"]

        # Prometheus gone: the size is held and the condition says why.
        proc.terminate()
        proc.wait(10)
        body = await until(
            lambda: (
                (b := stack.body()) and condition(b, "ScalingActive").get("status") == "False" and b
            ),
            20,
            "ScalingActive=False",
        )
        assert condition(body, "ScalingActive")["reason"] == "MetricsUnavailable"
        assert body["status"]["autoscaling"]["holding"] is True
        await asyncio.sleep(3)
        assert sorted((await asyncio.to_thread(stack.roles)).values()) == ["active", "warm"]
        assert len(await asyncio.to_thread(stack.pods)) == 2
    finally:
        await cancel_and_wait(syncer)
        await client.close()


async def test_scale_from_zero_wakes_a_replica_for_a_held_request(stack: Stack) -> None:
    """minReplicas 0: no engine runs; a request is held by the gateway, the autoscaler sees
    the held count, starts a replica, admits it, and the request is served; idle again, the
    fleet goes back to zero."""
    await asyncio.to_thread(stack.start_operator)
    spec = isvc(
        "llama",
        engine={"gpuType": "h100"},
        autoscaling={**AUTOSCALING, "minReplicas": 0, "warmReplicas": 0, "maxReplicas": 2},
    )
    await asyncio.to_thread(stack.env.kube.create, spec)
    body = await until(
        lambda: (b := stack.body()) and condition(b, "Ready").get("reason") == "ScaledToZero" and b,
        30,
        "Ready=False ScaledToZero",
    )
    assert not await asyncio.to_thread(stack.pods)
    url = await until(stack.gateway_url, 30, "a ready gateway pod")
    started = time.monotonic()
    assert await burst(str(url), 1, 16) == [200]
    woke_s = time.monotonic() - started
    body = await asyncio.to_thread(stack.body)
    assert body["status"]["autoscaling"]["desiredActive"] == 1
    print(f"a held request was served {woke_s:.1f}s after it arrived at a fleet of zero")
    await until(lambda: not live(stack.pods()), 40, "back to zero replicas")
    # ... and its process stopped (not only terminating) before the cluster goes away.
    await until(lambda: not stack.pods(), 60, "the engine pod gone")
