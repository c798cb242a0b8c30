"""The real operator (kopf + the `kubernetes` client) against the local cluster over HTTP:
children appear, status and conditions follow the pods, drift is repaired, a spec change
rolls the engine, an invalid spec surfaces as a condition, the scale subresource works, the
warm pool is labelled, and a steady state — or an operator restart — writes nothing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest
from kubernetes.client.exceptions import ApiException

from kvfleet_operator.handlers import Controller, OperatorConfig, run
from kvfleet_operator.kube import DEPLOYMENT, ISVC, POD, Kube, Resource, api_client
from kvfleet_sim.cluster.apiserver import ClusterAPI
from kvfleet_sim.cluster.controllers import Cluster
from kvfleet_sim.cluster.kubelet import KubeletConfig

ROOT = Path(__file__).resolve().parents[2]
NS = "ai"
CONFIGMAP = Resource("v1", "ConfigMap", "configmaps")
EVENTS = Resource("v1", "Event", "events")


def isvc(name: str = "llama", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {
                "name": "llama-3.1-8b",
                "source": {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"},
            },
            "engine": {"gpuType": "h100"},
            "gateway": {"insecureNoAuth": True},
            **spec,
        },
    }


@dataclass
class Env:
    api: ClusterAPI
    url: str
    kube: Kube  # the test's own client (its calls are not the operator's)


async def until(check: Callable[[], Any], limit_s: float = 15.0, what: str = "") -> Any:
    deadline = time.monotonic() + limit_s
    while True:
        value = await asyncio.to_thread(check)
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.05)


class OperatorThread:
    def __init__(self, url: str, resync_s: float = 30.0) -> None:
        self.kube = Kube(api_client(url))
        self.controller = Controller(self.kube, OperatorConfig(server=url, resync_s=resync_s))
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.outcomes: list[tuple[str, Any]] = []
        self.controller.on_outcome = lambda key, o: self.outcomes.append((key, o))

        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url, insecure=True)

        self.thread = threading.Thread(
            target=run,
            args=(self.controller,),
            kwargs={"stop_flag": self.stop, "ready_flag": self.ready, "login": login},
            daemon=True,
        )
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "the operator did not stop"


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    async with ClusterAPI() as api, kmock.Server(api) as server:
        api.load_resources()
        api.load_crds(ROOT / "crds")
        cluster = Cluster(api.store, KubeletConfig(run_processes=False, ready_delay_s=0.05))
        task = asyncio.create_task(cluster.run(resync_s=0.2))
        url = str(server.url).rstrip("/")
        client = api_client(url)
        client.user_agent = "kvfleet-test"
        try:
            yield Env(api, url, Kube(client))
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


@pytest.fixture
async def operator_factory(env: Env) -> AsyncIterator[Callable[[], Awaitable[OperatorThread]]]:
    # The API server runs in this loop: wait for the operator's thread without blocking it.
    started: list[OperatorThread] = []

    async def start() -> OperatorThread:
        op = OperatorThread(env.url)
        started.append(op)
        assert await asyncio.to_thread(op.ready.wait, 10), "the operator did not start"
        return op

    yield start
    for op in started:
        await asyncio.to_thread(op.close)


def condition(body: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((body or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c  # type: ignore[no-any-return]
    return {}


async def settle(env: Env, op: OperatorThread, quiet_s: float = 0.6) -> None:
    """Wait until the operator has made no write for `quiet_s`."""
    last = -1
    while True:
        n = op.kube.writes
        if n == last:
            return
        last = n
        await asyncio.sleep(quiet_s)


async def test_lifecycle(
    env: Env, operator_factory: Callable[[], Awaitable[OperatorThread]]
) -> None:
    op = await operator_factory()
    k = env.kube
    await asyncio.to_thread(k.create, isvc(replicas=2))

    body = await until(
        lambda: (
            (b := k.get(ISVC, NS, "llama")) and condition(b, "Ready").get("status") == "True" and b
        ),
        what="Ready=True",
    )
    st = body["status"]
    assert st["observedGeneration"] == body["metadata"]["generation"]
    assert (st["readyReplicas"], st["activeReplicas"], st["warmReplicas"], st["replicas"]) == (
        2,
        2,
        0,
        2,
    )
    assert st["selector"] == "kvfleet.dev/inferenceservice=llama,app.kubernetes.io/component=engine"
    assert st["gatewayURL"] == "http://llama.ai.svc:8080/v1"
    assert condition(body, "Degraded")["status"] == "False"
    kinds = {(o["kind"], o["metadata"]["name"]) for o in await asyncio.to_thread(_children, env)}
    assert kinds >= {
        ("Deployment", "llama-engine"),
        ("Service", "llama-engine"),
        ("PodDisruptionBudget", "llama-engine"),
        ("NetworkPolicy", "llama-engine"),
        ("Deployment", "llama-gateway"),
        ("Service", "llama"),
        ("ConfigMap", "llama-gateway"),
        ("ServiceAccount", "llama-gateway"),
        ("Role", "llama-gateway"),
        ("RoleBinding", "llama-gateway"),
    }
    # Events are posted right after the write they report: wait for them, as for the rest.
    await until(
        lambda: any(
            e["reason"] == "Serving" and e["involvedObject"]["name"] == "llama"
            for e in k.list(EVENTS, NS)
        ),
        what="a Serving event",
    )

    # Steady state: a reconcile reads and writes nothing.
    await settle(env, op)
    before_calls = dict(op.kube.calls)
    op.controller.enqueue(NS, "llama")
    await until(
        lambda: sum(op.kube.calls.values()) > sum(before_calls.values()) + 5, what="a reconcile"
    )
    await asyncio.sleep(0.5)
    delta = {v: op.kube.calls[v] - before_calls.get(v, 0) for v in op.kube.calls}
    assert {v: n for v, n in delta.items() if v != "GET" and n} == {}, delta
    assert delta["GET"] <= 20, f"a steady-state reconcile cost {delta['GET']} reads"
    print(f"steady-state reconcile: {delta['GET']} reads, 0 writes")

    # A deleted child comes back; a hand-edited one is repaired.
    await asyncio.to_thread(k.request, "DELETE", CONFIGMAP.path(NS, "llama-gateway"))
    await until(lambda: k.get(CONFIGMAP, NS, "llama-gateway"), what="the ConfigMap back")
    patch = {
        "spec": {"template": {"spec": {"containers": [{"name": "sglang", "image": "evil:latest"}]}}}
    }
    await asyncio.to_thread(k.patch, DEPLOYMENT, NS, "llama-engine", patch)
    await until(
        lambda: k.get(DEPLOYMENT, NS, "llama-engine")["spec"]["template"]["spec"]["containers"][0][
            "image"
        ].startswith("lmsysorg/sglang"),
        what="the engine image repaired",
    )
    await until(
        lambda: any(
            e["reason"] == "DriftRepaired" and "Deployment/llama-engine" in e["message"]
            for e in k.list(EVENTS, NS)
        ),
        what="a DriftRepaired event",
    )

    # A spec change rolls the engine Deployment: new pods replace the old ones.
    old_pods = {
        p["metadata"]["name"]
        for p in await asyncio.to_thread(k.list, POD, NS, "app.kubernetes.io/component=engine")
    }
    await asyncio.to_thread(
        k.patch, ISVC, NS, "llama", {"spec": {"engine": {"contextLength": 16384}}}
    )

    def rolled() -> bool:
        dep = k.get(DEPLOYMENT, NS, "llama-engine")
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        pods = k.list(POD, NS, "app.kubernetes.io/component=engine")
        names = {p["metadata"]["name"] for p in pods}
        return "16384" in args and len(pods) == 2 and not names & old_pods

    await until(rolled, what="the engine rolled")
    body = await until(
        lambda: (
            (b := k.get(ISVC, NS, "llama"))
            and b["status"]["observedGeneration"] == b["metadata"]["generation"]
            and condition(b, "Ready")["status"] == "True"
            and b
        ),
        what="status of the new generation",
    )

    # kubectl scale: the scale subresource drives spec.replicas, then the Deployment.
    await asyncio.to_thread(
        k.request,
        "PATCH",
        ISVC.path(NS, "llama", "scale"),
        {"spec": {"replicas": 3}},
        "application/merge-patch+json",
    )
    await until(lambda: k.get(ISVC, NS, "llama")["status"]["readyReplicas"] == 3, what="3 ready")

    # Disabling the gateway deletes its children (and only those).
    await asyncio.to_thread(k.patch, ISVC, NS, "llama", {"spec": {"gateway": {"enabled": False}}})
    await until(lambda: k.get(DEPLOYMENT, NS, "llama-gateway") is None, what="the gateway pruned")
    await until(lambda: k.get(CONFIGMAP, NS, "llama-gateway") is None, what="its config pruned")
    assert await asyncio.to_thread(k.get, DEPLOYMENT, NS, "llama-engine")
    body = await until(
        lambda: (b := k.get(ISVC, NS, "llama")) and "gatewayURL" not in b["status"] and b,
        what="status without a gateway URL",
    )

    # The API server rejects an invalid spec with the CRD's CEL rule ...
    with pytest.raises(ApiException) as rejected:
        await asyncio.to_thread(
            k.patch, ISVC, NS, "llama", {"spec": {"autoscaling": {"maxReplicas": 4}}}
        )
    assert rejected.value.status == 422
    assert "replicas and autoscaling are mutually exclusive" in rejected.value.body
    # ... and where one lets it through (a server without CEL), it becomes a condition.
    env.api.validate_custom_resources = False
    await asyncio.to_thread(
        k.patch, ISVC, NS, "llama", {"spec": {"autoscaling": {"maxReplicas": 4}}}
    )
    body = await until(
        lambda: (
            (b := k.get(ISVC, NS, "llama"))
            and condition(b, "Ready").get("reason") == "InvalidSpec"
            and b
        ),
        what="Ready=False InvalidSpec",
    )
    assert condition(body, "Ready")["status"] == "False"
    assert "spec.replicas" in condition(body, "Ready")["message"]
    await until(
        lambda: any(
            e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in k.list(EVENTS, NS)
        ),
        what="an InvalidSpec warning",
    )
    # ... and nothing was torn down.
    assert len(await asyncio.to_thread(k.list, POD, NS, "app.kubernetes.io/component=engine")) == 3

    # Deleting the InferenceService takes its children with it (ownerReferences, no finalizer).
    assert not body["metadata"].get("finalizers")
    await asyncio.to_thread(k.request, "DELETE", ISVC.path(NS, "llama"))
    await until(lambda: not _children(env), what="the children garbage-collected")
    await until(lambda: not k.list(POD, NS, "kvfleet.dev/inferenceservice=llama"), what="pods gone")


def _children(env: Env) -> list[dict[str, Any]]:
    from kvfleet_operator.kube import RESOURCES

    out = []
    for res in RESOURCES.values():
        if res.kind in ("InferenceService", "Event", "Pod", "PodMonitor"):
            continue
        out += env.kube.list(res, NS, "kvfleet.dev/inferenceservice=llama")
    return out


async def test_restart_writes_nothing_and_warm_pool(
    env: Env, operator_factory: Callable[[], Awaitable[OperatorThread]]
) -> None:
    k = env.kube
    op = await operator_factory()
    spec = isvc("warm", autoscaling={"minReplicas": 2, "maxReplicas": 5, "warmReplicas": 1})
    await asyncio.to_thread(k.create, spec)
    body = await until(
        lambda: (
            (b := k.get(ISVC, NS, "warm"))
            and (b.get("status") or {}).get("warmReplicas") == 1
            and condition(b, "Ready")["status"] == "True"
            and b
        ),
        what="one warm replica",
    )
    assert (body["status"]["activeReplicas"], body["status"]["desiredReplicas"]) == (2, 3)
    pods = await asyncio.to_thread(
        k.list, POD, NS, "kvfleet.dev/inferenceservice=warm,kvfleet.dev/role=warm"
    )
    assert len(pods) == 1
    await settle(env, op)
    await asyncio.to_thread(op.close)

    mark = len(env.api.request_log)
    op2 = await operator_factory()
    await until(
        lambda: any(key == f"{NS}/warm" for key, _ in op2.outcomes),
        what="a reconcile after restart",
    )
    await asyncio.sleep(1.0)
    writes = [
        r
        for r in env.api.request_log[mark:]
        if r[0] in ("POST", "PUT", "PATCH", "DELETE")
        and not r[2].startswith("kvfleet-test")
        and not (r[1].startswith("/api/v1/namespaces/ai/pods") and r[1].endswith("/status"))
    ]
    assert writes == [] or all(
        "/api/v1/namespaces/ai/pods" in w[1] and w[0] == "POST" for w in writes
    ), writes
    assert op2.kube.writes == 0
