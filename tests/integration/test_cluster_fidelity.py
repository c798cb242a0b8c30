"""The local cluster where users and GitOps tools notice, driven by the real kubectl: dry-run
leaves no trace, server-side apply owns fields (conflicts, removal), watch-list waits end,
logs, strict field validation, identity and RBAC, missing references hold a container, and
pods that all listen on 0.0.0.0 each get their own address."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml

from kvfleet_localcluster.emulated import EmulatedCluster
from tests.conftest import kubectl_binary, require_binary
from tests.support.emulated import emulated_cluster_config as cluster_config
from tests.support.kubectl import kubectl, kubectl_error, run_kubectl
from tests.support.objects import ROOT, isvc
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
async def cluster(tmp_path: Path) -> AsyncIterator[EmulatedCluster]:
    """Pods run as processes (`kvfleet ...` commands), kubelet timing ×0.05."""
    config = cluster_config(tmp_path, run_processes=True, time_scale=0.05)
    async with EmulatedCluster(config) as local:
        yield local


async def k(cluster: EmulatedCluster, *args: str, stdin: str | None = None) -> str:
    return await kubectl(cluster.kubeconfig, *args, stdin=stdin)


async def k_err(cluster: EmulatedCluster, *args: str, stdin: str | None = None) -> str:
    return await kubectl_error(cluster.kubeconfig, *args, stdin=stdin)


async def get(cluster: EmulatedCluster, *what: str) -> Any:
    return json.loads(await k(cluster, "get", *what, "-o", "json", "--show-managed-fields"))


# ---- dry-run -----------------------------------------------------------------------------------
async def test_dry_run_leaves_no_trace(cluster: EmulatedCluster) -> None:
    """`kubectl diff` and `--dry-run=server` once wrote for real: Argo CD's diff would mutate."""
    doc = isvc("llama", replicas=1)
    await k(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(doc))
    before = await get(cluster, "kis", "llama")
    rv = cluster.api.store.rv
    changed = isvc("llama", replicas=3)
    code, out, _ = await run_kubectl(
        cluster.kubeconfig, "diff", "-f", "-", stdin=yaml.safe_dump(changed)
    )
    assert code == 1 and "replicas: 3" in out  # diff found the change (exit 1) ...
    out = await k(cluster, "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(changed))
    assert "(server dry run)" in out
    new = isvc("other", replicas=1)
    await k(cluster, "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(new))
    await k(cluster, "delete", "--dry-run=server", "kis", "llama")
    # ... and nothing changed: same object, no new resourceVersion, nothing created or deleted.
    after = await get(cluster, "kis", "llama")
    assert after["spec"] == before["spec"] and after["metadata"] == before["metadata"]
    assert cluster.api.store.rv == rv
    assert "NotFound" in await k_err(cluster, "get", "kis", "other")
    # A dry-run create is validated like a real one.
    bad = isvc("bad", replicas=-1)
    err = await k_err(cluster, "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(bad))
    assert "spec.replicas" in err


# ---- server-side apply -------------------------------------------------------------------------
async def test_server_side_apply_owns_fields(cluster: EmulatedCluster) -> None:
    web = deployment("web", 1, ["kvfleet", "--version"], tier="web")
    await k(cluster, "apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(web))
    obj = await get(cluster, "deployment", "web")
    managers = {e["manager"]: e for e in obj["metadata"]["managedFields"]}
    assert managers["kubectl"]["operation"] == "Apply"
    assert "f:tier" in managers["kubectl"]["fieldsV1"]["f:metadata"]["f:labels"]
    # Another manager setting a field kubectl owns to another value: a conflict ...
    scaled = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"}}
    scaled["spec"] = {"replicas": 3}
    doc = yaml.safe_dump(scaled)
    err = await k_err(
        cluster, "apply", "--server-side", "--field-manager=hpa", "-f", "-", stdin=doc
    )
    assert "conflict" in err.lower() and "spec.replicas" in err and '"kubectl"' in err
    assert (await get(cluster, "deployment", "web"))["spec"]["replicas"] == 1
    # ... which --force-conflicts takes over.
    args = ("apply", "--server-side", "--field-manager=hpa", "--force-conflicts", "-f", "-")
    await k(cluster, *args, stdin=doc)
    obj = await get(cluster, "deployment", "web")
    assert obj["spec"]["replicas"] == 3
    owners = {e["manager"]: e["fieldsV1"] for e in obj["metadata"]["managedFields"]}
    assert "f:replicas" in owners["hpa"]["f:spec"]
    assert "f:replicas" not in owners["kubectl"].get("f:spec", {})
    # A field kubectl no longer applies, and no one else owns, is removed.
    web["metadata"]["labels"].pop("tier")
    web["spec"].pop("replicas")
    await k(cluster, "apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(web))
    obj = await get(cluster, "deployment", "web")
    assert "tier" not in obj["metadata"]["labels"] and obj["spec"]["replicas"] == 3
    # A plain write names its manager too (kubectl's client-side apply / edit / scale).
    await k(cluster, "scale", "deployment", "web", "--replicas=2")
    fields = await get(cluster, "deployment", "web")
    updaters = {e["manager"] for e in fields["metadata"]["managedFields"]}
    assert "kubectl" in updaters or "kubectl-scale" in updaters


# ---- watch-list: wait and rollout status without feature-gate overrides -------------------------
async def test_wait_and_rollout_status_end(cluster: EmulatedCluster) -> None:
    web = deployment("web", 2, ["kvfleet", *SIM[1:], "--host", "0.0.0.0", "--port", "30000"])
    await k(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(web))
    out = await k(cluster, "rollout", "status", "deployment/web", "--timeout=60s")
    assert "successfully rolled out" in out
    out = await k(cluster, "wait", "--for=condition=Available", "deployment/web", "--timeout=30s")
    assert "condition met" in out
    out = await k(cluster, "wait", "--for=condition=Ready", "pod", "-l", "app=web", "--timeout=30s")
    assert out.count("condition met") == 2


# ---- logs --------------------------------------------------------------------------------------
async def test_logs_follow_previous_container_and_tail(cluster: EmulatedCluster) -> None:
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


def _kubectl_argv(cluster: EmulatedCluster) -> list[str]:
    from tests.conftest import kubectl_binary

    cache = str(cluster.kubeconfig.parent / "kube-cache")
    return [kubectl_binary(), "--kubeconfig", str(cluster.kubeconfig), "--cache-dir", cache]


# ---- field validation --------------------------------------------------------------------------
async def test_field_validation_strict_warn_ignore(cluster: EmulatedCluster) -> None:
    doc = isvc("typo", replicas=1)
    doc["spec"]["replicass"] = 2
    text = yaml.safe_dump(doc)
    err = await k_err(cluster, "apply", "-f", "-", stdin=text)  # kubectl: Strict by default
    assert 'strict decoding error: unknown field "spec.replicass"' in err
    assert "NotFound" in await k_err(cluster, "get", "kis", "typo")
    code, _, err = await run_kubectl(
        cluster.kubeconfig, "apply", "--validate=warn", "-f", "-", stdin=text
    )
    assert code == 0 and 'unknown field "spec.replicass"' in err
    doc["metadata"]["name"] = "typo2"
    code, _, err = await run_kubectl(
        cluster.kubeconfig, "apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(doc)
    )
    assert code == 0 and "unknown field" not in err
    assert "replicass" not in (await get(cluster, "kis", "typo2"))["spec"]  # pruned


async def test_field_validation_of_built_in_kinds_at_every_depth(cluster: EmulatedCluster) -> None:
    """A typo deep in a Deployment's pod template fails `kubectl apply` as kube-apiserver's
    strict decoder fails it; under --validate=warn it is applied without the field (the
    decoder drops it); a map's keys (labels, resource limits) are never unknown fields."""
    doc = deployment("typo", 0, ["sleep", "60"], tier="web")
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["imagePullPolicyy"] = "Always"
    container["resources"] = {"limits": {"cpu": "1", "memory": "64Mi"}}
    text = yaml.safe_dump(doc)
    err = await k_err(cluster, "apply", "-f", "-", stdin=text)
    assert (
        'Deployment in version "v1" cannot be handled as a Deployment: strict decoding error: '
        'unknown field "spec.template.spec.containers[0].imagePullPolicyy"'
    ) in err
    assert "NotFound" in await k_err(cluster, "get", "deployment", "typo")
    code, _, err = await run_kubectl(
        cluster.kubeconfig, "apply", "--validate=warn", "-f", "-", stdin=text
    )
    assert code == 0, err
    assert 'unknown field "spec.template.spec.containers[0].imagePullPolicyy"' in err
    stored = (await get(cluster, "deployment", "typo"))["spec"]["template"]["spec"]
    assert "imagePullPolicyy" not in stored["containers"][0]
    assert stored["containers"][0]["resources"]["limits"] == {"cpu": "1", "memory": "64Mi"}
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "typo"},
           "spec": {"ports": [{"port": 80, "targetPortt": 8080}]}}  # fmt: skip
    err = await k_err(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(svc))
    assert 'unknown field "spec.ports[0].targetPortt"' in err


async def test_zero_values_of_omitempty_fields_are_not_stored(cluster: EmulatedCluster) -> None:
    """What a real API server returns has no `publishNotReadyAddresses: false`, `env: []` or
    `value: ""`: its encoder leaves zero values of omitempty fields out, so a controller
    that renders them sees a difference on every read. `replicas: 0` (a pointer) stays."""
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "zeros"},
           "spec": {"ports": [{"port": 80}], "publishNotReadyAddresses": False}}  # fmt: skip
    doc = deployment("zeros", 0, ["sleep", "60"])
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": "EMPTY", "value": ""}]
    container["args"] = []
    text = yaml.safe_dump_all([svc, doc])
    await k(cluster, "apply", "--server-side", "-f", "-", stdin=text)
    assert "publishNotReadyAddresses" not in (await get(cluster, "service", "zeros"))["spec"]
    stored = (await get(cluster, "deployment", "zeros"))["spec"]
    assert stored["replicas"] == 0
    c = stored["template"]["spec"]["containers"][0]
    assert c["env"] == [{"name": "EMPTY"}] and "args" not in c


# ---- identity and RBAC -------------------------------------------------------------------------
async def test_authentication_and_rbac(cluster: EmulatedCluster) -> None:
    assert (await k(cluster, "auth", "can-i", "create", "pods")).strip() == "yes"
    assert "kvfleet-admin" in await k(cluster, "auth", "whoami")
    await k(cluster, "create", "serviceaccount", "reader")
    token = (await k(cluster, "create", "token", "reader")).strip()
    as_reader = ("--token", token)
    code, out, _ = await run_kubectl(
        cluster.kubeconfig, *as_reader, "auth", "can-i", "list", "pods", stdin=None
    )
    assert (code, out.strip()) == (1, "no")
    err = await k_err(cluster, *as_reader, "get", "pods")
    assert 'User "system:serviceaccount:ai:reader" cannot list resource "pods"' in err
    await k(cluster, "create", "role", "pod-reader", "--verb=get,list,watch", "--resource=pods")
    await k(
        cluster, "create", "rolebinding", "r", "--role=pod-reader", "--serviceaccount=ai:reader"
    )
    assert (await k(cluster, *as_reader, "auth", "can-i", "list", "pods")).strip() == "yes"
    code, out, _ = await run_kubectl(
        cluster.kubeconfig, *as_reader, "auth", "can-i", "list", "pods", "-n", "default", stdin=None
    )
    assert out.strip() == "no"  # a Role grants in its namespace only
    await k(cluster, *as_reader, "get", "pods")
    assert "Unauthorized" in await k_err(cluster, "--token", "not-a-token", "get", "pods")
    # No one grants more than they hold: a role-writer cannot hand out secrets.
    await k(cluster, "create", "role", "role-writer", "--verb=create", "--resource=roles")
    await k(
        cluster, "create", "rolebinding", "w", "--role=role-writer", "--serviceaccount=ai:reader"
    )
    err = await k_err(
        cluster, *as_reader, "create", "role", "s", "--verb=get", "--resource=secrets"
    )
    assert "attempting to grant RBAC permissions not currently held" in err
    await k(cluster, *as_reader, "create", "role", "p", "--verb=get", "--resource=pods")  # held
    # A deleted ServiceAccount's tokens stop working.
    await k(cluster, "delete", "serviceaccount", "reader")
    assert "Unauthorized" in await k_err(cluster, *as_reader, "get", "pods")


async def test_pods_log_in_with_their_service_account(cluster: EmulatedCluster) -> None:
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
    assert (user, namespace, ip) == ("system:serviceaccount:ai:default", "ai", pod_ip)


async def _first_line_with(cluster: EmulatedCluster, pod_name: str, word: str) -> str | None:
    code, out, _ = await run_kubectl(cluster.kubeconfig, "logs", pod_name, stdin=None)
    lines = [line for line in out.splitlines() if line.startswith(word)]
    return lines[0] if code == 0 and lines else None


# ---- missing references ------------------------------------------------------------------------
async def test_missing_secret_configmap_key_and_pvc_hold_the_container(
    cluster: EmulatedCluster,
) -> None:
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
        lambda: _contains(get(cluster, "pod", "p"), "couldn't find key token in Secret ai/hf"),
        10,
        "the missing key reported",
    ), message
    await k(cluster, "delete", "secret", "hf")
    await k(cluster, "apply", "-f", "-", stdin=secret("hf", token="t"))
    await k(cluster, "wait", "--for=condition=Ready", "pod/p", "--timeout=30s")
    # A volume of a missing PVC: ContainerCreating (Pending) until the claim exists.
    volumes = [{"name": "cache", "persistentVolumeClaim": {"claimName": "model-cache"}}]
    mounts = {"volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}
    spec = pod("q", [*SIM, "--port", "30001"], volumes=volumes, container=mounts)
    await k(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(spec))
    assert await until(lambda: _eq(status_of("q"), "ContainerCreating"), 10, "ContainerCreating")
    assert (await get(cluster, "pod", "q"))["status"]["phase"] == "Pending"
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


async def describe(cluster: EmulatedCluster, pod_name: str) -> str:
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
    cluster: EmulatedCluster,
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
    cluster: EmulatedCluster,
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
    reader, writer = await asyncio.open_connection("redis.ai.svc.cluster.local", 6379)
    writer.write(b"PING\\r\\n"); await writer.drain()
    print("asyncio", (await reader.readline()).decode().strip(), flush=True)
    loop = asyncio.get_running_loop()
    for name in ("redis", "redis.ai", "redis.ai.svc"):
        infos = await loop.getaddrinfo(name, 6379, type=socket.SOCK_STREAM)
        print(name, infos[0][4][0], infos[0][4][1], flush=True)
uvloop.run(main())
"""


async def test_a_statefulset_of_redis_is_reached_by_its_service_name_and_keeps_its_data(
    cluster: EmulatedCluster, tmp_path: Path
) -> None:
    """examples/redis.yaml as written: the StatefulSet controller creates redis-0 and its
    claim data-redis-0, the kubelet runs the `redis` image as this machine's redis-server on
    the pod's address, a pod reaches it as redis.ai.svc (cluster DNS and kube-proxy), and a
    replaced redis-0 finds its data on the claim's volume."""
    require_binary("redis-server")
    await k(cluster, "apply", "-f", str(ROOT / "examples" / "redis.yaml"))
    await k(cluster, "rollout", "status", "statefulset/redis", "--timeout=60s")
    sts = await get(cluster, "statefulset", "redis")
    assert sts["status"]["readyReplicas"] == 1 and sts["status"]["updatedReplicas"] == 1
    assert (await get(cluster, "pvc", "data-redis-0"))["metadata"]["name"] == "data-redis-0"
    ip = (await get(cluster, "pod", "redis-0"))["status"]["podIP"]
    r = aioredis.Redis(host=ip, port=6379)
    await until(lambda: _answer(r.ping()), 20, "redis-0 answering on its pod address")
    await r.set("budget", "42")
    await r.aclose()

    client = pod("client", ["python", "-c", RESOLVE_AND_PING], restartPolicy="Never")
    await k(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(client))

    async def logged() -> str | None:
        out = await k(cluster, "logs", "client")
        return out if "redis.ai.svc" in out else None

    out = await until(logged, 30, "the client pod's output")
    assert "asyncio +PONG" in out, out
    for name in ("redis", "redis.ai", "redis.ai.svc"):
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


async def _ready(cluster: EmulatedCluster, name: str) -> bool:
    for p in (await get(cluster, "pods"))["items"]:
        if p["metadata"]["name"] == name and not p["metadata"].get("deletionTimestamp"):
            conditions = (p.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
    return False
