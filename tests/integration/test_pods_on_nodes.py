"""Pods on the local cluster's node agents, driven by the real kubectl through the real API
server: logs (follow, previous, tail), a pod's own ServiceAccount login, missing Secrets and
keys holding a container, `kubectl port-forward svc/...` serving the OpenAI SDK, pods that
all listen on 0.0.0.0 each on their own address, and a StatefulSet's Redis reached by its
Service name that keeps its data on its claim. (What the API server itself does — dry-run,
server-side apply, field validation, RBAC — is kube-apiserver's own: not ours to test.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml

from tests.conftest import kubectl_binary, require_binary
from tests.support.cluster import Env
from tests.support.examples import apply_example
from tests.support.kubectl import kubectl, kubectl_error, run_kubectl
from tests.support.waiting import until

SIM = ["kvfleet", "sim", "serve", "--model-path", "llama-3.1-8b", "--gpu", "h100"]
READY_ON_30000 = {"httpGet": {"path": "/health", "port": 30000}, "periodSeconds": 1}
"""Without a readiness probe a pod is Ready when its process starts, before it listens."""


def deployment(name: str, replicas: int, command: list[str], **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": {"app": name, **labels}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": "kvfleet:1",
                            "command": command,
                            "readinessProbe": READY_ON_30000,
                        }
                    ]
                },
            },
        },
    }


def pod(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "kvfleet:1", "command": command}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [container], **spec},
    }


@pytest.fixture
def cluster(process_cluster: Env) -> Env:
    """A namespace of this test's own whose pods run as processes (kubelet timing ×0.05)."""
    return process_cluster


async def k(cluster: Env, *args: str, stdin: str | None = None) -> str:
    return await kubectl(cluster.kubeconfig, *args, stdin=stdin)


async def k_err(cluster: Env, *args: str, stdin: str | None = None) -> str:
    return await kubectl_error(cluster.kubeconfig, *args, stdin=stdin)


async def get(cluster: Env, *what: str) -> Any:
    return json.loads(await k(cluster, "get", *what, "-o", "json"))


# ---- logs --------------------------------------------------------------------------------------
async def test_logs_follow_previous_container_and_tail(cluster: Env) -> None:
    engine = pod(
        "engine",
        [*SIM, "--host", "0.0.0.0", "--port", "30000"],
        container={"readinessProbe": READY_ON_30000},
    )
    await k(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(engine))
    await k(cluster, "wait", "--for=condition=Ready", "pod/engine", "--timeout=30s")
    out = await k(cluster, "logs", "engine")
    assert "kvfleet sim: simulated SGLang engine serving llama-3.1-8b" in out
    assert (
        await k(cluster, "logs", "engine", "-c", "main", "--tail=1") == out.splitlines()[-1] + "\n"
    )
    # (kubectl checks a container name itself; the server says the same for other clients.)
    assert "container nope is not valid" in await k_err(cluster, "logs", "engine", "-c", "nope")
    assert "previous terminated container" in await k_err(cluster, "logs", "engine", "--previous")
    # -f streams the live process and ends when it does.
    proc = await asyncio.create_subprocess_exec(
        *_kubectl_argv(cluster), "logs", "-f", "engine", stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    first = await asyncio.wait_for(proc.stdout.readline(), 10)
    assert b"kvfleet sim" in first
    await asyncio.sleep(0.5)
    assert proc.returncode is None  # still following a running container
    await k(cluster, "delete", "pod", "engine", "--wait=false")
    assert await asyncio.wait_for(proc.wait(), 15) == 0
    # --previous: a container that exits and restarts keeps its last run's output.
    await k(
        cluster, "apply", "-f", "-", stdin=yaml.safe_dump(pod("once", ["kvfleet", "--version"]))
    )

    async def restarted() -> bool:
        status = (await get(cluster, "pod", "once")).get("status") or {}
        return any(c.get("restartCount", 0) >= 1 for c in status.get("containerStatuses") or [])

    await until(restarted, 20, "a restart")
    assert "version" in (await k(cluster, "logs", "once", "--previous")).lower()


def _kubectl_argv(cluster: Env) -> list[str]:
    cache = str(cluster.kubeconfig.parent / "kube-cache")
    return [kubectl_binary(), "--kubeconfig", str(cluster.kubeconfig), "--cache-dir", cache]


# ---- identity ----------------------------------------------------------------------------------
async def test_pods_log_in_with_their_service_account(cluster: Env) -> None:
    """The kubelet's projected volume and env: a pod's process reaches the API as its account."""
    probe = (
        "import json,os,ssl,urllib.request as u;"
        "d='/var/run/secrets/kubernetes.io/serviceaccount/';"
        "h=os.environ['KUBERNETES_SERVICE_HOST']+':'+os.environ['KUBERNETES_SERVICE_PORT'];"
        "r=u.Request('https://'+h+'/apis/authentication.k8s.io/v1/selfsubjectreviews',"
        'data=b\'{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}\','
        "headers={'Authorization':'Bearer '+open(d+'token').read(),"
        "'Content-Type':'application/json'});"
        "c=ssl.create_default_context(cafile=d+'ca.crt');"
        "print('whoami', json.load(u.urlopen(r,context=c))['status']['userInfo']['username'],"
        "open(d+'namespace').read(), os.environ['MY_IP'], flush=True)"
    )
    downward = {"fieldRef": {"fieldPath": "status.podIP"}}
    spec = pod(
        "whoami",
        ["python3", "-c", probe],
        container={"env": [{"name": "MY_IP", "valueFrom": downward}]},
    )
    await k(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(spec))
    line = await until(
        lambda: _first_line_with(cluster, "whoami", "whoami"), 20, "the pod's own login"
    )
    _, user, namespace, ip = line.split()
    pod_ip = (await get(cluster, "pod", "whoami"))["status"]["podIP"]
    ns = cluster.ns
    assert (user, namespace, ip) == (f"system:serviceaccount:{ns}:default", ns, pod_ip)


async def _first_line_with(cluster: Env, pod_name: str, word: str) -> str | None:
    code, out, _ = await run_kubectl(cluster.kubeconfig, "logs", pod_name, stdin=None)
    lines = [line for line in out.splitlines() if line.startswith(word)]
    return lines[0] if code == 0 and lines else None


# ---- missing references ------------------------------------------------------------------------
async def test_a_missing_secret_key_or_secret_volume_holds_the_container(cluster: Env) -> None:
    """As a kubelet: a missing Secret or key is `CreateContainerConfigError` until it exists, a
    missing Secret volume a FailedMount Event. (A missing claim is the scheduler's: the pod is
    never bound to a node.)"""
    ns = cluster.ns
    env = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    await k(
        cluster,
        "apply",
        "-f",
        "-",
        stdin=yaml.safe_dump(pod("p", [*SIM, "--port", "30000"], container={"env": env})),
    )

    async def status_of(name: str) -> str:
        out = await k(cluster, "get", "pod", name, "--no-headers")
        return out.split()[2]

    assert await until(
        lambda: _eq(status_of("p"), "CreateContainerConfigError"), 10, "config error"
    )
    described = await k(cluster, "describe", "pod", "p")
    assert "Warning  Failed" in described and 'Error: secret "hf" not found' in described
    await k(cluster, "apply", "-f", "-", stdin=secret("hf", other="x"))
    message = (await get(cluster, "pod", "p"))["status"]["containerStatuses"][0]["state"]
    assert await until(
        lambda: _contains(get(cluster, "pod", "p"), f"couldn't find key token in Secret {ns}/hf"),
        10,
        "the missing key reported",
    ), message
    await k(cluster, "delete", "secret", "hf")
    await k(cluster, "apply", "-f", "-", stdin=secret("hf", token="t"))
    await k(cluster, "wait", "--for=condition=Ready", "pod/p", "--timeout=30s")
    # As a real kubelet: the reason is in a FailedMount Event (not the container's state),
    # which `kubectl describe` shows; repeats are counted on one Event.
    volumes = [{"name": "keys", "secret": {"secretName": "api-keys"}}]
    mounts = {"volumeMounts": [{"name": "keys", "mountPath": "/keys"}]}
    spec = pod("r", [*SIM, "--port", "30002"], volumes=volumes, container=mounts)
    await k(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(spec))
    assert await until(lambda: _eq(status_of("r"), "ContainerCreating"), 10, "ContainerCreating")
    failed_mount = 'MountVolume.SetUp failed for volume "keys" : secret "api-keys" not found'

    async def shown() -> bool:
        return failed_mount in await describe(cluster, "r")

    assert await until(shown, 10, "a FailedMount Event")
    assert "Warning  FailedMount" in await describe(cluster, "r")
    assert (
        "message"
        not in (await get(cluster, "pod", "r"))["status"]["containerStatuses"][0]["state"][
            "waiting"
        ]
    )

    async def counted() -> bool:
        events = yaml.safe_load(await k(cluster, "get", "events", "-o", "json"))["items"]
        return any(e["reason"] == "FailedMount" and e["count"] >= 2 for e in events)

    assert await until(counted, 10, "a repeat counted on the same Event")


async def describe(cluster: Env, pod_name: str) -> str:
    return await k(cluster, "describe", "pod", pod_name)


def secret(name: str, **data: str) -> str:
    # (`kubectl create secret` sends protobuf and does not fall back to JSON on 415.)
    doc = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data}
    return yaml.safe_dump(doc)


async def _eq(value: Any, wanted: str) -> bool:
    return bool(await value == wanted)


async def _contains(value: Any, wanted: str) -> bool:
    return wanted in json.dumps(await value)


# ---- port-forward ------------------------------------------------------------------------------
async def test_kubectl_port_forward_to_a_service_serves_the_openai_sdk(
    cluster: Env,
) -> None:
    """`kubectl port-forward svc/...` as examples/openai_client.py tells users: kubectl 1.37
    tunnels SPDY through a WebSocket to pods/portforward (it failed: "POST is not allowed
    here"); kubectl picks the Service's pod and maps the port; the OpenAI SDK streams through
    it, and a second connection reuses the session."""
    import openai

    container = {"readinessProbe": READY_ON_30000}
    spec = pod("engine", [*SIM, "--host", "0.0.0.0", "--port", "30000"], container=container)
    spec["metadata"]["labels"] = {"app": "engine"}
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "engine"},
        "spec": {"selector": {"app": "engine"},
                 "ports": [{"name": "http", "port": 8000, "targetPort": 30000}]},
    }  # fmt: skip
    await k(cluster, "apply", "-f", "-", stdin=yaml.safe_dump_all([spec, service]))
    await k(cluster, "wait", "--for=condition=Ready", "pod/engine", "--timeout=60s")
    proc = await asyncio.create_subprocess_exec(
        kubectl_binary(), "--kubeconfig", str(cluster.kubeconfig), "port-forward", "svc/engine",
        ":8000", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        assert line.startswith("Forwarding from 127.0.0.1:") and line.endswith("-> 30000\n"), line
        local = int(line.split("127.0.0.1:")[1].split()[0])
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{local}/v1", api_key="-")
        try:
            for _ in range(2):
                stream = await client.chat.completions.create(
                    model="llama-3.1-8b", messages=[{"role": "user", "content": "hi"}],
                    max_tokens=8, stream=True, stream_options={"include_usage": True},
                )  # fmt: skip
                chunks = [c async for c in stream]
                assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        finally:
            await client.close()
    finally:
        proc.terminate()
        _, err = await proc.communicate()
    assert b"error" not in err.lower(), err


# ---- pod network -------------------------------------------------------------------------------
async def test_three_pods_listening_on_the_wildcard_each_get_their_own_address(
    cluster: Env,
) -> None:
    engines = deployment("engines", 3, [*SIM, "--host", "0.0.0.0", "--port", "30000"])
    await k(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(engines))
    await k(cluster, "rollout", "status", "deployment/engines", "--timeout=60s")
    pods = (await get(cluster, "pods", "-l", "app=engines"))["items"]
    ips = sorted(p["status"]["podIP"] for p in pods)
    assert len(set(ips)) == 3
    assert all(c["restartCount"] == 0 for p in pods for c in p["status"]["containerStatuses"])
    async with aiohttp.ClientSession() as s:
        for ip in ips:
            async with s.get(f"http://{ip}:30000/v1/models") as r:
                assert r.status == 200


# ---- StatefulSets, Service names, persistent volumes -----------------------------------------
RESOLVE_AND_PING = """
import asyncio, socket, sys, uvloop
async def main():
    ns = sys.argv[1]
    reader, writer = await asyncio.open_connection(f"redis.{ns}.svc.cluster.local", 6379)
    writer.write(b"PING\\r\\n"); await writer.drain()
    print("asyncio", (await reader.readline()).decode().strip(), flush=True)
    loop = asyncio.get_running_loop()
    for name in ("redis", f"redis.{ns}", f"redis.{ns}.svc"):
        infos = await loop.getaddrinfo(name, 6379, type=socket.SOCK_STREAM)
        print(name, infos[0][4][0], infos[0][4][1], flush=True)
uvloop.run(main())
"""


async def test_a_statefulset_of_redis_is_reached_by_its_service_name_and_keeps_its_data(
    cluster: Env,
) -> None:
    """examples/redis.yaml as written (in the test's namespace): the StatefulSet controller
    creates redis-0 and its claim data-redis-0, the node agent runs the `redis` image as this
    machine's redis-server on the pod's address, a pod reaches it as redis.NS.svc (cluster DNS
    and kube-proxy), and a replaced redis-0 finds its data on the claim's volume."""
    require_binary("redis-server")
    ns = cluster.ns
    await apply_example(cluster.kubeconfig, ns, "redis.yaml")
    await k(cluster, "rollout", "status", "statefulset/redis", "--timeout=60s")
    sts = await get(cluster, "statefulset", "redis")
    assert sts["status"]["readyReplicas"] == 1 and sts["status"]["updatedReplicas"] == 1
    assert (await get(cluster, "pvc", "data-redis-0"))["metadata"]["name"] == "data-redis-0"
    ip = (await get(cluster, "pod", "redis-0"))["status"]["podIP"]
    r = aioredis.Redis(host=ip, port=6379)
    await until(lambda: _answer(r.ping()), 20, "redis-0 answering on its pod address")
    await r.set("budget", "42")
    await r.aclose()

    client = pod("client", ["python", "-c", RESOLVE_AND_PING, ns], restartPolicy="Never")
    await k(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(client))

    async def logged() -> str | None:
        out = await k(cluster, "logs", "client")
        return out if f"redis.{ns}.svc" in out else None

    out = await until(logged, 30, "the client pod's output")
    assert "asyncio +PONG" in out, out
    for name in ("redis", f"redis.{ns}", f"redis.{ns}.svc"):
        assert f"{name} {ip} 6379" in out, out

    # Replaced: the same name, the same claim, the same data (append-only file on the volume).
    await k(cluster, "delete", "pod", "redis-0", "--wait=true")
    await until(
        lambda: _ready(cluster, "redis-0"),
        60,
        "redis-0 recreated and Ready",
    )
    ip = (await get(cluster, "pod", "redis-0"))["status"]["podIP"]
    r = aioredis.Redis(host=ip, port=6379)
    assert await until(lambda: _answer(r.get("budget")), 20, "the key back") == b"42"
    await r.aclose()


async def _answer(call: Any) -> Any:
    try:
        return await call
    except aioredis.RedisError:
        return None


async def _ready(cluster: Env, name: str) -> bool:
    for p in (await get(cluster, "pods"))["items"]:
        if p["metadata"]["name"] == name and not p["metadata"].get("deletionTimestamp"):
            conditions = (p.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
    return False
