"""The real operator (kopf + the `kubernetes` client) against the local cluster over HTTP:
children appear, status and conditions follow the pods, drift is repaired, a spec change
rolls the engine, an invalid spec surfaces as a condition, the scale subresource works, the
warm pool is labelled, and a steady state — or an operator restart — writes nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kvfleet_localcluster.controlplane import ADMIN_USER, ControlPlane, ControlPlaneConfig
from kvfleet_operator.kube import DEPLOYMENT, EVENT, ISVC, POD, RESOURCES, Kube, Resource
from kvfleet_operator.login import Credentials, api_client
from tests.support.cluster import (
    TEST_AGENT,
    Env,
    OperatorFactory,
    OperatorThread,
    require_control_plane,
)
from tests.support.kubectl import kubectl
from tests.support.objects import NS, condition, isvc
from tests.support.shared_cluster import compact_etcd
from tests.support.waiting import until

CONFIGMAP = Resource("v1", "ConfigMap", "configmaps")
EVENTS = Resource("v1", "Event", "events")
ENGINE_PODS = "app.kubernetes.io/component=engine"


async def settle(env: Env, op: OperatorThread, quiet_s: float = 0.6) -> None:
    """Wait until the operator has made no write for `quiet_s`."""
    last = -1
    while True:
        n = op.kube.writes
        if n == last:
            return
        last = n
        await asyncio.sleep(quiet_s)


async def ready_service(env: Env, name: str = "llama", **spec: Any) -> dict[str, Any]:
    """Create an InferenceService and wait for Ready=True with every replica ready (Ready
    turns True with the first: pods become Ready one by one); its body."""
    ns, k = env.ns, env.kube
    await asyncio.to_thread(k.create, isvc(name, ns, **spec))

    def ready() -> dict[str, Any] | None:
        b = k.get(ISVC, ns, name)
        status = (b or {}).get("status") or {}
        every = status.get("readyReplicas") == spec.get("replicas", status.get("readyReplicas"))
        return b if condition(b, "Ready").get("status") == "True" and every else None

    return await until(ready, 30, f"{name} Ready=True, every replica ready")  # type: ignore[no-any-return]


def children(env: Env, name: str = "llama") -> list[dict[str, Any]]:
    ns = env.ns
    out = []
    for res in RESOURCES.values():
        if res.kind in ("InferenceService", "Event", "Pod", "PodMonitor", "LeaderWorkerSet"):
            continue  # (CRDs this cluster does not have)
        out += env.kube.list(res, ns, f"kvfleet.dev/inferenceservice={name}")
    return out


async def ready_because(env: Env, name: str, reason: str) -> dict[str, Any]:
    """The InferenceService once its Ready condition gives this reason."""
    k, ns = env.kube, env.ns
    return await until(  # type: ignore[no-any-return]
        lambda: (
            (b := k.get(ISVC, ns, name)) and condition(b, "Ready").get("reason") == reason and b
        ),
        what=f"{name} Ready reason {reason}",
    )


def has_event(env: Env, reason: str, text: str = "") -> bool:
    ns = env.ns
    return any(
        e["reason"] == reason and text in (e.get("message") or "") + e["involvedObject"]["name"]
        for e in env.kube.list(EVENTS, ns)
    )


@pytest.fixture
async def llama(local_cluster: Env, operator_factory: OperatorFactory) -> OperatorThread:
    """The operator, logged in with the cluster's kubeconfig, serving `llama` (2 replicas)."""
    op = await operator_factory()
    await ready_service(local_cluster, replicas=2)
    return op


async def test_children_status_and_events(local_cluster: Env, llama: OperatorThread) -> None:
    ns = local_cluster.ns
    env = local_cluster
    body = await asyncio.to_thread(env.kube.get, ISVC, ns, "llama")
    st = body["status"]
    assert st["observedGeneration"] == body["metadata"]["generation"]
    assert (st["readyReplicas"], st["activeReplicas"], st["warmReplicas"], st["replicas"]) == (
        2,
        2,
        0,
        2,
    )
    assert st["selector"] == "kvfleet.dev/inferenceservice=llama,app.kubernetes.io/component=engine"
    assert st["gatewayURL"] == f"http://llama.{ns}.svc:8080/v1"
    assert condition(body, "Degraded")["status"] == "False"
    kinds = {(o["kind"], o["metadata"]["name"]) for o in await asyncio.to_thread(children, env)}
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
    await until(lambda: has_event(env, "Serving", "llama"), what="a Serving event")


async def test_steady_state_reads_and_writes_nothing(
    local_cluster: Env, llama: OperatorThread
) -> None:
    """A reconcile of an unchanged world costs the API server nothing: its reads come from
    the watch cache (it once cost 12 GETs per service per resync) and it writes nothing."""
    ns = local_cluster.ns
    op = llama
    await settle(local_cluster, op)
    assert op.kube.cache is not None
    before, hits, done = dict(op.kube.calls), op.kube.cache.hits, len(op.outcomes)
    op.controller.enqueue(ns, "llama")
    await until(lambda: len(op.outcomes) > done, what="a reconcile")
    await asyncio.sleep(0.5)
    delta = {v: op.kube.calls[v] - before.get(v, 0) for v in op.kube.calls}
    assert {v: n for v, n in delta.items() if n} == {}, delta
    assert op.kube.cache.hits - hits >= 10  # the ~dozen reads, answered by the cache
    print(f"steady-state reconcile: {op.kube.cache.hits - hits} cached reads, 0 requests")


async def test_drift_is_repaired(local_cluster: Env, llama: OperatorThread) -> None:
    ns = local_cluster.ns
    env, k = local_cluster, local_cluster.kube
    # A deleted child comes back; a hand-edited one is repaired.
    await asyncio.to_thread(k.request, "DELETE", CONFIGMAP.path(ns, "llama-gateway"))
    await until(lambda: k.get(CONFIGMAP, ns, "llama-gateway"), what="the ConfigMap back")
    patch = {
        "spec": {"template": {"spec": {"containers": [{"name": "sglang", "image": "evil:latest"}]}}}
    }
    await asyncio.to_thread(k.patch, DEPLOYMENT, ns, "llama-engine", patch)
    await until(
        lambda: k.get(DEPLOYMENT, ns, "llama-engine")["spec"]["template"]["spec"]["containers"][0][
            "image"
        ].startswith("lmsysorg/sglang"),
        what="the engine image repaired",
    )
    await until(
        lambda: has_event(env, "DriftRepaired", "Deployment/llama-engine"),
        what="a DriftRepaired event",
    )


async def test_spec_change_rolls_and_scale_subresource(
    local_cluster: Env, llama: OperatorThread
) -> None:
    ns = local_cluster.ns
    k = local_cluster.kube
    old_pods = {
        p["metadata"]["name"] for p in await asyncio.to_thread(k.list, POD, ns, ENGINE_PODS)
    }
    await asyncio.to_thread(
        k.patch, ISVC, ns, "llama", {"spec": {"engine": {"contextLength": 16384}}}
    )

    def rolled() -> bool:
        dep = k.get(DEPLOYMENT, ns, "llama-engine")
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        pods = k.list(POD, ns, ENGINE_PODS)
        names = {p["metadata"]["name"] for p in pods}
        return "16384" in args and len(pods) == 2 and not names & old_pods

    await until(rolled, what="the engine rolled")
    await until(
        lambda: (
            (b := k.get(ISVC, ns, "llama"))
            and b["status"]["observedGeneration"] == b["metadata"]["generation"]
            and condition(b, "Ready")["status"] == "True"
        ),
        what="status of the new generation",
    )
    # kubectl scale: the scale subresource drives spec.replicas, then the Deployment.
    await asyncio.to_thread(
        k.request,
        "PATCH",
        ISVC.path(ns, "llama", "scale"),
        {"spec": {"replicas": 3}},
        "application/merge-patch+json",
    )
    await until(lambda: k.get(ISVC, ns, "llama")["status"]["readyReplicas"] == 3, what="3 ready")


async def test_disabled_gateway_is_pruned(local_cluster: Env, llama: OperatorThread) -> None:
    ns = local_cluster.ns
    k = local_cluster.kube
    await asyncio.to_thread(k.patch, ISVC, ns, "llama", {"spec": {"gateway": {"enabled": False}}})
    await until(lambda: k.get(DEPLOYMENT, ns, "llama-gateway") is None, what="the gateway pruned")
    await until(lambda: k.get(CONFIGMAP, ns, "llama-gateway") is None, what="its config pruned")
    assert await asyncio.to_thread(k.get, DEPLOYMENT, ns, "llama-engine")
    await until(
        lambda: "gatewayURL" not in k.get(ISVC, ns, "llama")["status"],
        what="status without a gateway URL",
    )


async def test_invalid_spec_is_refused_then_surfaces(
    local_cluster: Env, llama: OperatorThread
) -> None:
    ns = local_cluster.ns
    k = local_cluster.kube
    # The API server rejects an invalid spec with the CRD's CEL rule ...
    with pytest.raises(ApiException) as rejected:
        await asyncio.to_thread(
            k.patch, ISVC, ns, "llama", {"spec": {"autoscaling": {"maxReplicas": 4}}}
        )
    assert rejected.value.status == 422
    assert "replicas and autoscaling are mutually exclusive" in rejected.value.body
    # ... and the service serves on, untouched. (The operator's own check of a spec a server
    # without CEL lets through is a unit test's: a real server always runs the rule.)
    body = await asyncio.to_thread(k.get, ISVC, ns, "llama")
    assert "autoscaling" not in body["spec"]
    assert condition(body, "Ready")["status"] == "True"
    assert len(await asyncio.to_thread(k.list, POD, ns, ENGINE_PODS)) == 2


async def test_a_multi_node_service_without_leader_worker_set_says_so(
    local_cluster: Env, llama: OperatorThread
) -> None:
    """No LeaderWorkerSet API on this cluster: a multi-node service renders nothing and its
    condition says what to install; the single-node service beside it is untouched."""
    ns = local_cluster.ns
    env, k = local_cluster, local_cluster.kube
    doc = isvc("big", ns, engine={"gpuType": "h100", "tensorParallel": 8, "nodesPerReplica": 2})
    await asyncio.to_thread(k.create, doc)
    body = await ready_because(env, "big", "LeaderWorkerSetMissing")
    message = condition(body, "Ready")["message"]
    assert "spec.engine.nodesPerReplica" in message and "install LeaderWorkerSet" in message
    await until(lambda: has_event(env, "LeaderWorkerSetMissing"), what="a warning Event")
    assert await asyncio.to_thread(children, env, "big") == []
    assert condition(await asyncio.to_thread(k.get, ISVC, ns, "llama"), "Ready")["status"] == "True"


async def test_deletion_collects_children(local_cluster: Env, llama: OperatorThread) -> None:
    ns = local_cluster.ns
    env, k = local_cluster, local_cluster.kube
    body = await asyncio.to_thread(k.get, ISVC, ns, "llama")
    # Deleting the InferenceService takes its children with it (ownerReferences, no finalizer).
    assert not body["metadata"].get("finalizers")
    await asyncio.to_thread(k.request, "DELETE", ISVC.path(ns, "llama"))
    await until(lambda: not children(env), what="the children garbage-collected")
    await until(lambda: not k.list(POD, ns, "kvfleet.dev/inferenceservice=llama"), what="pods gone")


async def test_restart_writes_nothing_and_warm_pool(
    local_cluster: Env, operator_factory: OperatorFactory
) -> None:
    ns = local_cluster.ns
    env, k = local_cluster, local_cluster.kube
    op = await operator_factory()
    spec = isvc("warm", ns, autoscaling={"minReplicas": 2, "maxReplicas": 5, "warmReplicas": 1})
    await asyncio.to_thread(k.create, spec)
    body = await until(
        lambda: (
            (b := k.get(ISVC, ns, "warm"))
            and (b.get("status") or {}).get("warmReplicas") == 1
            and condition(b, "Ready")["status"] == "True"
            and b
        ),
        what="one warm replica",
    )
    assert (body["status"]["activeReplicas"], body["status"]["desiredReplicas"]) == (2, 3)
    pods = await asyncio.to_thread(
        k.list, POD, ns, "kvfleet.dev/inferenceservice=warm,kvfleet.dev/role=warm"
    )
    assert len(pods) == 1
    await settle(env, op)
    await asyncio.to_thread(op.close)

    audit = env.audit()
    op2 = await operator_factory()
    await until(
        lambda: any(key == f"{ns}/warm" for key, _ in op2.outcomes),
        what="a reconcile after restart",
    )
    await asyncio.sleep(1.0)
    # The API server's own record: no write by the admin's user (the operator's login) in
    # this namespace but the test's, kopf's included (the control plane's are not recorded).
    writes = [
        (e["verb"], e["requestURI"], e.get("userAgent"))
        for e in audit.iter_complete()
        if e["verb"] in ("create", "update", "patch", "delete", "deletecollection")
        and e["user"]["username"] == ADMIN_USER
        and (e.get("objectRef") or {}).get("namespace") == ns
        and not (e.get("userAgent") or "").startswith(TEST_AGENT)
    ]
    assert writes == [], writes
    assert op2.kube.writes == 0

    # `kubectl scale` of the autoscaled engine Deployment: taken back whole, and said so.
    await until(
        lambda: ((k.get(ISVC, ns, "warm") or {}).get("status") or {}).get("autoscaling"),
        30,
        "a first autoscaling decision",
    )

    await kubectl(env.kubeconfig, "scale", "deployment/warm-engine", "--replicas=5")
    events = await until(
        lambda: [e for e in k.list(EVENT, ns) if e.get("reason") == "ManualScaleReverted"],
        30,
        "a ManualScaleReverted Event",
    )
    assert "was scaled to 5 by kubectl" in events[0]["message"], events[0]["message"]
    assert "change minReplicas or maxReplicas instead" in events[0]["message"]
    await until(
        lambda: (k.get(DEPLOYMENT, ns, "warm-engine") or {})["spec"]["replicas"] == 3,
        30,
        "the decided replicas back",
    )


async def test_a_pod_held_by_a_missing_secret_names_it_in_the_condition(
    local_cluster: Env, operator_factory: OperatorFactory
) -> None:
    """The gateway's key Secret does not exist: its pod stays ContainerCreating and the
    kubelet says why only in a FailedMount Event. Ready=False names the Secret (it said a
    generic GatewayUnavailable); once the Secret exists the service serves."""
    ns = local_cluster.ns
    k = local_cluster.kube
    await operator_factory()
    await asyncio.to_thread(
        k.create, isvc("llama", ns, replicas=1, gateway={"apiKeysSecret": "team-keys"})
    )

    def held() -> dict[str, Any] | None:
        ready = condition(k.get(ISVC, ns, "llama"), "Ready")
        # On the real server an engine pod can first report its own key Secret missing for
        # a moment; the condition must come to name the user's Secret.
        named = "team-keys" in ready.get("message", "")
        return ready if ready.get("reason") == "ReferenceNotFound" and named else None

    # The chain is scheduler, node agent (FailedMount Event), operator resync: seconds when
    # idle, and it missed 15 s twice with the in-cluster stories beside it. It asserts what
    # the condition says, not how fast: a minute.
    ready = await until(held, 60.0, "Ready=False, ReferenceNotFound naming team-keys")
    assert ready["status"] == "False"
    assert 'secret "team-keys" not found' in ready["message"], ready
    assert ready["message"].startswith("pod llama-gateway-"), ready
    keys = "tenants: [{name: a, keys: ['sha256:" + "0" * 64 + "']}]\n"
    secret = {"metadata": {"name": "team-keys", "namespace": ns}, "stringData": {"keys.yaml": keys}}
    secret_doc = {"apiVersion": "v1", "kind": "Secret", **secret}
    await asyncio.to_thread(k.request, "POST", f"/api/v1/namespaces/{ns}/secrets", secret_doc)
    await until(
        lambda: condition(k.get(ISVC, ns, "llama"), "Ready").get("status") == "True",
        60.0,
        "Ready=True once the Secret exists",
    )


async def test_an_object_holding_a_childs_name_is_never_adopted(
    local_cluster: Env, operator_factory: OperatorFactory
) -> None:
    """A user's Service named like the InferenceService (its gateway Service's name): the
    operator used to merge-patch its labels, selector and ownerReferences on the 409, so the
    Service pointed at the gateway and was garbage-collected with the InferenceService. Now it
    is untouched, Ready=False says NameConflict naming it, with an Event; deleting the
    InferenceService leaves it; the adopt annotation lets the operator take it over."""
    ns = local_cluster.ns
    k = local_cluster.kube
    svc_path = f"/api/v1/namespaces/{ns}/services"
    mine = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "llama", "namespace": ns, "labels": {"team": "web"}},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8000}]},
    }
    await asyncio.to_thread(k.request, "POST", svc_path, mine)
    before = await asyncio.to_thread(k.request, "GET", f"{svc_path}/llama")
    await operator_factory()
    await asyncio.to_thread(k.create, isvc("llama", ns, replicas=1))

    def conflict() -> dict[str, Any] | None:
        ready = condition(k.get(ISVC, ns, "llama"), "Ready")
        return ready if ready.get("reason") == "NameConflict" else None

    ready = await until(conflict, what="Ready=False, NameConflict")
    assert ready["status"] == "False"
    assert ready["message"].startswith("Service llama exists and is not controlled by this"), ready
    assert "kvfleet.dev/adopt=llama" in ready["message"]
    await until(lambda: has_event(local_cluster, "NameConflict"), what="a NameConflict Event")
    after = await asyncio.to_thread(k.request, "GET", f"{svc_path}/llama")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["spec"]["selector"] == {"app": "web"}
    assert not after["metadata"].get("ownerReferences")
    # The other children were made as usual (the engine Service among them).
    assert await asyncio.to_thread(k.request, "GET", f"{svc_path}/llama-engine")
    # Deleting the InferenceService takes its own children, not the user's Service.
    await asyncio.to_thread(k.request, "DELETE", ISVC.path(ns, "llama"))
    await until(lambda: not children(local_cluster), what="its children garbage-collected")
    kept = await asyncio.to_thread(k.request, "GET", f"{svc_path}/llama")
    assert kept["spec"]["selector"] == {"app": "web"}
    # Asked to, the operator takes it over (for a service created under that name again).
    adopt = {"metadata": {"annotations": {"kvfleet.dev/adopt": "llama"}}}
    await asyncio.to_thread(
        k.request, "PATCH", f"{svc_path}/llama", adopt, "application/merge-patch+json"
    )
    await asyncio.to_thread(k.create, isvc("llama", ns, replicas=1))
    taken = await until(
        lambda: (
            (s := k.request("GET", f"{svc_path}/llama"))["metadata"].get("ownerReferences") and s
        ),
        what="the Service taken over",
    )
    assert taken["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    assert taken["metadata"]["labels"]["kvfleet.dev/inferenceservice"] == "llama"


async def test_a_hung_api_server_or_prometheus_times_out() -> None:
    """Servers that accept a connection and never answer: the operator's API requests and the
    autoscaler's Prometheus queries fail after their timeouts (they waited forever, stalling
    the single reconcile worker or all autoscaling)."""
    import time

    import kubernetes

    from kvfleet_operator.scaling.observe import PrometheusReader

    held: list[asyncio.StreamWriter] = []

    async def accept_and_hang(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept_and_hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    configuration = kubernetes.client.Configuration()
    configuration.host = f"http://127.0.0.1:{port}"
    kube = Kube(kubernetes.client.ApiClient(configuration), timeout_s=0.5)
    prometheus = PrometheusReader(f"http://127.0.0.1:{port}", timeout_s=0.5)
    try:
        for call in (
            lambda: kube.request("GET", "/api/v1/namespaces"),
            lambda: prometheus._vector("up", ()),
        ):
            started = time.monotonic()
            with pytest.raises(Exception, match=r"(?i)timed? ?out") as err:
                await asyncio.to_thread(call)
            waited = time.monotonic() - started
            assert waited < 10, (waited, err.value)
    finally:
        server.close()
        for w in held:
            w.close()


async def test_a_child_the_api_server_refuses_is_reported_in_status(
    local_cluster: Env, operator_factory: OperatorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An API server that answers 422 to one child (an admission policy, a quota, a field it
    validates that the CRD does not): Ready=False, ReconcileError names the kind, the name
    and the server's message, with one Event, and the other children are made; once the
    server accepts it, the next retry creates it and the condition clears. (It used to
    retry forever with nothing in status or Events.)"""
    ns = local_cluster.ns

    real_apply = Kube.apply
    refusing = {"on": True}

    def apply(self: Kube, obj: dict[str, Any]) -> dict[str, Any]:
        if refusing["on"] and obj["kind"] == "ConfigMap":
            body = '{"kind":"Status","message":"admission webhook denied: no ConfigMaps here"}'
            exc = ApiException(status=422, reason="Unprocessable Entity")
            exc.body = body
            raise exc
        return real_apply(self, obj)

    monkeypatch.setattr(Kube, "apply", apply)
    k = local_cluster.kube
    await operator_factory()
    await asyncio.to_thread(k.create, isvc("llama", ns, replicas=1))

    def refused() -> dict[str, Any] | None:
        ready = condition(k.get(ISVC, ns, "llama"), "Ready")
        return ready if ready.get("reason") == "ReconcileError" else None

    ready = await until(refused, what="Ready=False, ReconcileError")
    assert ready["status"] == "False"
    assert ready["message"] == (
        "ConfigMap llama-gateway: 422 admission webhook denied: no ConfigMaps here"
    ), ready
    await until(lambda: has_event(local_cluster, "ReconcileError", "422"), what="an Event")
    engine = await asyncio.to_thread(k.get, DEPLOYMENT, ns, "llama-engine")
    assert engine is not None  # the rest was made
    refusing["on"] = False
    await until(
        lambda: condition(k.get(ISVC, ns, "llama"), "Ready").get("reason") != "ReconcileError",
        30,
        what="the condition cleared after a retry",
    )
    events = [
        e for e in await asyncio.to_thread(k.list, EVENTS, ns) if e["reason"] == "ReconcileError"
    ]
    assert len(events) == 1  # retries with the same refusal post nothing more


async def test_a_hung_api_server_turns_the_liveness_probe_unhealthy(
    local_cluster: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """The operator's API server stops answering (accepts, never replies): every reconcile
    times out, and once no reconcile has succeeded for the stall limit with work pending,
    the liveness endpoint answers 500 (the reason in the log), so the kubelet restarts it
    (its probe stayed green while one hung connection stalled the single worker)."""
    ns = local_cluster.ns
    import aiohttp
    import kubernetes

    from kvfleet_sim.procs import free_port
    from tests.support.cluster import OperatorThread

    held: list[asyncio.StreamWriter] = []

    async def accept_and_hang(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept_and_hang, "127.0.0.1", 0)
    hung = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    url = f"http://127.0.0.1:{free_port()}/healthz"
    op = OperatorThread(
        local_cluster.credentials, liveness_endpoint=url, stall_s=2.0, namespaces=(ns,)
    )
    try:
        assert await asyncio.to_thread(op.ready.wait, 10)

        async def probe() -> tuple[int, str]:
            async with aiohttp.ClientSession() as s:
                for _ in range(50):  # the endpoint starts with kopf's watches
                    try:
                        async with s.get(url) as r:
                            return r.status, await r.text()
                    except aiohttp.ClientConnectionError:
                        await asyncio.sleep(0.1)
            raise AssertionError("no liveness endpoint")

        assert (await probe())[0] == 200
        # The operator's own client now talks to a server that never answers; kopf's watches
        # (their own connections) still deliver the new InferenceService.
        configuration = kubernetes.client.Configuration()
        configuration.host = hung
        op.kube.api = kubernetes.client.ApiClient(configuration)
        op.kube.timeout_s = 0.5
        await asyncio.to_thread(local_cluster.kube.create, isvc("llama", ns, replicas=1))

        async def unhealthy() -> str | None:
            status, text = await probe()
            return text if status == 500 else None

        # kopf caches probe results for 10 s: allow for that on top of the 2 s limit.
        await until(unhealthy, 25, "the liveness endpoint unhealthy", interval=1.0)
        assert "liveness: no reconcile has succeeded for" in caplog.text
    finally:
        await asyncio.to_thread(op.close)
        server.close()
        for w in held:
            w.close()


async def assert_a_reconcile_writes_nothing(env: Env, op: OperatorThread) -> None:
    """Once settled, one more reconcile of llama issues no write. On a loaded machine a pod
    can still turn Ready after the quiet spell (a true status change, rightly written): up to
    three tries, each after settling again; an operator that writes every time still fails."""
    writes = []
    for _ in range(3):
        await settle(env, op)
        before, done = op.kube.writes, len(op.outcomes)
        op.controller.enqueue(env.ns, "llama")
        await until(lambda: len(op.outcomes) > done, what="a reconcile")  # noqa: B023
        writes.append(op.kube.writes - before)
        if writes[-1] == 0:
            return
    pytest.fail(f"every settled reconcile wrote: {writes} writes")


async def test_fields_a_spec_stops_rendering_leave_the_children_and_others_stay(
    local_cluster: Env, operator_factory: OperatorFactory
) -> None:
    """Children are server-side applied: a field the spec no longer asks for (a node
    selector, tolerations, a priority class) disappears from the Deployment, while what
    another manager set (an annotation a user or a mesh added) stays; the operator's
    ownership is recorded as an Apply in managedFields. (With superset comparison and merge
    patches the old values stayed forever.)"""
    ns = local_cluster.ns
    k = local_cluster.kube
    op = await operator_factory()
    scheduling = {
        "nodeSelector": {"pool": "gpu-a"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "inference",
    }
    await asyncio.to_thread(k.create, isvc("llama", ns, replicas=0, scheduling=scheduling))

    def pod_spec() -> dict[str, Any]:
        engine = k.get(DEPLOYMENT, ns, "llama-engine") or {}
        return engine.get("spec", {}).get("template", {}).get("spec", {})  # type: ignore[no-any-return]

    await until(lambda: pod_spec().get("priorityClassName") == "inference", what="the engine")
    assert (await asyncio.to_thread(pod_spec))["nodeSelector"]["pool"] == "gpu-a"
    engine = await asyncio.to_thread(k.get, DEPLOYMENT, ns, "llama-engine")
    managers = {(m["manager"], m["operation"]) for m in engine["metadata"]["managedFields"]}
    assert ("kvfleet-operator", "Apply") in managers, managers
    mesh = {"metadata": {"annotations": {"mesh.example/inject": "true"}}}
    await asyncio.to_thread(k.patch, DEPLOYMENT, ns, "llama-engine", mesh)

    # As `kubectl patch --type merge` would remove it: no resourceVersion precondition, so the
    # operator's own status writes cannot make it a 409.
    unset = {"spec": {"scheduling": None}}
    await asyncio.to_thread(k.patch, ISVC, ns, "llama", unset)
    await until(lambda: "priorityClassName" not in pod_spec(), what="the priority class gone")
    spec = await asyncio.to_thread(pod_spec)
    assert "pool" not in (spec.get("nodeSelector") or {}), spec.get("nodeSelector")
    assert not any(t.get("key") == "gpu" for t in spec.get("tolerations") or []), spec
    engine = await asyncio.to_thread(k.get, DEPLOYMENT, ns, "llama-engine")
    assert engine["metadata"]["annotations"]["mesh.example/inject"] == "true"
    # And the new steady state writes nothing.
    await assert_a_reconcile_writes_nothing(local_cluster, op)


async def test_fields_an_earlier_operator_wrote_by_update_are_taken_over_and_dropped(
    local_cluster: Env, operator_factory: OperatorFactory
) -> None:
    """An earlier kvfleet repaired its children by merge patch: its fields sit under an
    `Update` entry of the operator's manager, which an apply never releases, so a field it
    no longer renders would stay forever. The operator moves that entry into its `Apply`
    entry (as client-go's csaupgrade does) and the next apply drops the stale field, while
    what another manager wrote stays."""
    ns = local_cluster.ns
    k = local_cluster.kube
    op = await operator_factory()
    await asyncio.to_thread(k.create, isvc("llama", ns, replicas=0))
    await until(lambda: k.get(DEPLOYMENT, ns, "llama-engine"), what="the engine")
    await settle(local_cluster, op)
    path = DEPLOYMENT.path(ns, "llama-engine")

    def merge_patch(body: dict[str, Any], manager: str) -> Any:
        return k.request(
            "PATCH", path, body, "application/merge-patch+json", query={"fieldManager": manager}
        )

    # What an earlier operator left: a node selector it wrote by merge patch (an Update).
    old = {"spec": {"template": {"spec": {"nodeSelector": {"pool": "retired"}}}}}
    # (Checked on the patch's own answer: the running operator may fold the entry into its
    # Apply entry as soon as its watch sees the change, which is what this test is about.)
    written = await asyncio.to_thread(merge_patch, old, "kvfleet-operator")
    entries = {(m["manager"], m["operation"]) for m in written["metadata"]["managedFields"]}
    assert ("kvfleet-operator", "Update") in entries, entries
    mesh = {"metadata": {"annotations": {"mesh.example/inject": "true"}}}
    await asyncio.to_thread(merge_patch, mesh, "mesh-injector")

    op.controller.enqueue(ns, "llama")

    def selector() -> Any:
        deployment = k.get(DEPLOYMENT, ns, "llama-engine") or {}
        return deployment["spec"]["template"]["spec"].get("nodeSelector") or {}

    await until(lambda: "pool" not in selector(), what="the stale node selector dropped")
    engine = await asyncio.to_thread(k.get, DEPLOYMENT, ns, "llama-engine")
    entries = {(m["manager"], m["operation"]) for m in engine["metadata"]["managedFields"]}
    assert ("kvfleet-operator", "Update") not in entries, entries
    assert ("kvfleet-operator", "Apply") in entries, entries
    assert engine["metadata"]["annotations"]["mesh.example/inject"] == "true"
    # And from there the steady state writes nothing.
    await assert_a_reconcile_writes_nothing(local_cluster, op)


async def test_the_api_server_sends_the_operator_only_its_children(
    local_cluster: Env, llama: OperatorThread
) -> None:
    """The child watches carry the operator's label selector, so the API server filters: a
    cluster's other ConfigMaps and Services never reach the operator (kopf's `labels=` filter
    ran in the client, after the API server had streamed every one of them). A child whose
    labels are removed leaves the selector — the watch reports it gone — and the operator
    reads it from the API server and applies the labels back."""
    ns = local_cluster.ns
    k, op = local_cluster.kube, llama
    await settle(local_cluster, op)
    configmaps = next(i for i, _ in op.controller.informers if i.resource.plural == "configmaps")
    services = next(i for i, _ in op.controller.informers if i.resource.plural == "services")
    before = configmaps.events + services.events
    for i in range(20):
        other = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"other-{i}"}}
        await asyncio.to_thread(k.request, "POST", CONFIGMAP.path(ns), other)
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "someone-else"},
        "spec": {"ports": [{"port": 80}], "selector": {"app": "x"}},
    }
    await asyncio.to_thread(k.request, "POST", RESOURCES[("v1", "Service")].path(ns), svc)
    await asyncio.sleep(1.0)
    assert configmaps.events + services.events == before  # nothing of theirs was sent
    assert op.kube.cache is not None
    assert op.kube.cache.get("configmaps", ns, "other-0") is None

    unlabel = [{"op": "remove", "path": "/metadata/labels/app.kubernetes.io~1managed-by"}]
    path = CONFIGMAP.path(ns, "llama-gateway")
    await asyncio.to_thread(k.request, "PATCH", path, unlabel, "application/json-patch+json")

    def relabelled() -> bool:
        labels = (k.get(CONFIGMAP, ns, "llama-gateway") or {})["metadata"].get("labels") or {}
        return labels.get("app.kubernetes.io/managed-by") == "kvfleet"

    await until(relabelled, what="the operator's labels applied back")


async def test_a_relist_after_410_drops_what_vanished(tmp_path: Path) -> None:
    """An informer whose watch resumes from a resourceVersion the server no longer holds
    (410 Gone) relists, and the relist replaces the cache's contents: an object deleted
    while it was away is gone from the cache, and its owner is told. (A control plane of its
    own: ConfigMap watches served from etcd, not the API server's watch cache, which would
    keep serving the compacted history from memory.)"""
    from kvfleet_operator.cache import WatchCache
    from kvfleet_operator.informer import Gone, Informer

    require_control_plane()
    config = ControlPlaneConfig(
        state_dir=tmp_path / "cp",
        namespace=NS,
        lws=False,
        monitoring_crds=False,
        apiserver_args=("--watch-cache-sizes=configmaps#0",),
    )
    async with ControlPlane(config) as cp:
        k = Kube(api_client(Credentials(kubeconfig=str(cp.kubeconfig))))
        labels = {"app.kubernetes.io/managed-by": "kvfleet", "kvfleet.dev/inferenceservice": "a"}
        for name in ("keep", "goes"):
            cm = {"metadata": {"name": name, "labels": labels}}
            await asyncio.to_thread(k.request, "POST", CONFIGMAP.path(NS), cm)
        cache, changed = WatchCache(), []
        informer = Informer(
            k, CONFIGMAP, NS, "app.kubernetes.io/managed-by=kvfleet", cache, changed.append
        )
        rv = await asyncio.to_thread(informer.relist)
        names = {o["metadata"]["name"] for o in cache.list("configmaps", NS, None)}
        assert names == {"keep", "goes"}
        informer.watch_s = 2  # if it did not end with 410, this test would fail, not hang
        await asyncio.to_thread(k.request, "DELETE", CONFIGMAP.path(NS, "goes"))
        await asyncio.to_thread(
            k.request, "POST", CONFIGMAP.path(NS), {"metadata": {"name": "other"}}
        )
        # etcd forgets the history before its latest revision, as the API server's periodic
        # compaction makes it do.
        await compact_etcd(f"http://127.0.0.1:{cp.ports.etcd_client}")
        with pytest.raises(Gone):
            await asyncio.to_thread(informer.watch, rv)
        await asyncio.to_thread(informer.relist)
        assert [o["metadata"]["name"] for o in cache.list("configmaps", NS, None)] == ["keep"]
        assert [o["metadata"]["name"] for o in changed] == ["goes"]
