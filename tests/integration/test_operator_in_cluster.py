"""The operator installed as users install it: `kubectl apply -k manifests/`, running as a pod
under its own ServiceAccount and ClusterRole, logged in with the projected token; the
examples applied with kubectl serve a request through their gateway. Every request the
operator makes is authorized by RBAC, so a verb its ClusterRole lacks fails here, and a
verb it is granted but never uses is reported (least privilege)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from kvfleet_localcluster.local import LocalCluster
from kvfleet_operator.status import pod_ready
from tests.conftest import kubectl_binary
from tests.support.argocd import health
from tests.support.cluster import AUDIT_LOG, cluster_config
from tests.support.kubectl import kubectl
from tests.support.objects import ROOT
from tests.support.shared_cluster import AuditLog
from tests.support.waiting import until

OPERATOR = "system:serviceaccount:kvfleet-system:kvfleet-operator"
KUBECTL_POLL_S = 0.5
"""Between two checks that run kubectl (a process, and API calls, each time): at the
default 50 ms, a minute's wait starts some 1,200 kubectl processes on a two-core machine."""
READY_WITHIN_S = 240
"""Every example Ready, from the apply: some 25 pods start together on two cores, each a
Python process (40-100 s here, under load)."""
CHILD_KINDS = (
    "deployments",
    "services",
    "configmaps",
    "serviceaccounts",
    "poddisruptionbudgets",
    "networkpolicies",
    "roles",
    "rolebindings",
    "podmonitors",
    "persistentvolumeclaims",
    "leaderworkersets",
)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    """A cluster of this test's own (the operator is installed cluster-wide): no kvfleet CRD
    (the manifests install it, as on a fresh cluster), the LeaderWorkerSet controller and
    the Prometheus Operator's CRDs (the multi-node example and PodMonitors need them)."""
    config = cluster_config(
        tmp_path, crds=False, lws=True, monitoring=True, run_processes=True, time_scale=0.05
    )
    async with LocalCluster(config) as local:
        yield local


async def run(cluster: LocalCluster, *argv: str) -> tuple[int, str, str]:
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    return int(proc.returncode or 0), out.decode(), err.decode()


async def admin_cli(cluster: LocalCluster) -> None:
    kvfleet = str(Path(sys.executable).parent / "kvfleet")
    code, out, err = await run(cluster, kvfleet, "get")  # the kubeconfig's namespace: ai
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split() == ["NAME", "MODEL", "READY", "ACTIVE", "WARM", "QUEUE", "KV",
                              "TTFT-P99", "COST/1K", "AGE"]  # fmt: skip
    mistral = next(r.split() for r in rows if r.startswith("mistral "))
    assert mistral[:5] == ["mistral", "mistral-7b", "2/2", "2", "0"]
    # The kubectl plugin is the same program: kubectl finds `kubectl-kvfleet` on the PATH.
    code, out, err = await run(cluster, kubectl_binary(), "kvfleet", "get", "-A", "-o", "wide")
    assert code == 0, err
    assert out.split()[0] == "NAMESPACE" and "GATEWAY" in out.splitlines()[0]
    assert any(line.split()[:2] == ["ai", "llama-8b"] for line in out.splitlines())
    # kubectl's plugin completion runs kubectl_complete-kvfleet: names from the cluster.
    code, out, err = await run(cluster, kubectl_binary(), "__complete", "kvfleet", "describe", "")
    assert code == 0 and {"mistral", "llama-8b"} <= set(out.split()), (out, err)
    code, out, err = await run(cluster, kvfleet, "get", "mistral", "-o", "json")
    assert code == 0 and json.loads(out)["metadata"]["name"] == "mistral", err
    code, out, err = await run(cluster, kvfleet, "describe", "mistral", "-n", "ai")
    assert code == 0, err
    for expected in (r"Name:\s+mistral", r"Ready\s+True\s+Serving",
                     r"Deployment/mistral-engine\s+2/2",
                     r"PodMonitor/mistral-engine", r"mistral-engine-\S+\s+engine\s+active\s+True",
                     r"Normal\s+Created"):  # fmt: skip
        assert re.search(expected, out), (expected, out)
    code, out, err = await run(
        cluster, kvfleet, "logs", "mistral", "--component", "engine", "--tail", "1"
    )
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and all(line.startswith("[pod/mistral-engine-") for line in lines)
    code, out, err = await run(cluster, kvfleet, "top", "mistral", "--once")
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split() == ["POD", "ROLE", "READY", "QUEUE", "RUNNING", "KV", "HIT-RATE",
                              "TOKENS/S"]  # fmt: skip
    engines = [r.split() for r in rows if r.startswith("mistral-engine-")]
    assert len(engines) == 2 and all(e[1:3] == ["active", "True"] for e in engines), out
    assert all(e[3] != "-" and e[5].endswith("%") for e in engines), out  # scraped
    assert rows[-1].split()[:4] == ["TOTAL", "2", "pods", "2"]
    await top_on_a_pipe(cluster, kvfleet)
    code, out, err = await run(cluster, kvfleet, "usage", "mistral")  # the gateway pods' /metrics
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split()[:4] == ["TENANT", "REQUESTS", "OK", "429"]
    search = next(r.split() for r in rows if r.startswith("search-team"))
    # The two chats above (every example's, then mistral's again), 4 tokens each.
    assert search[1:3] == ["2", "2"] and search[5] == "8"
    code, out, err = await run(cluster, kvfleet, "get", "nope")
    assert code == 1 and "NotFound" in err and "-n NAMESPACE" in err, err


async def top_on_a_pipe(cluster: LocalCluster, kvfleet: str) -> None:
    """`kvfleet top` with stdout a pipe prints a whole frame each interval, as it reads it
    (it printed nothing until it was stopped)."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    proc = await asyncio.create_subprocess_exec(
        kvfleet, "top", "mistral", "--interval", "0.5", env=env, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    frames = 0
    try:
        async with asyncio.timeout(20):
            while frames < 2:
                line = (await proc.stdout.readline()).decode()
                frames += line.startswith("ai/mistral — ")
    finally:
        proc.terminate()
        await proc.wait()
    assert frames == 2


async def operator_metrics(cluster: LocalCluster) -> None:
    """The operator pod's own /metrics (port 8081, as manifests/ declare it)."""
    from prometheus_client.parser import text_string_to_metric_families

    pods = json.loads(
        await kubectl(cluster.kubeconfig, "get", "pods", "-n", "kvfleet-system", "-o", "json")
    )["items"]
    ip = pods[0]["status"]["podIP"]
    async with aiohttp.ClientSession() as s, s.get(f"http://{ip}:8081/metrics") as r:
        text = await r.text()
    values = {
        (m.name, tuple(sorted(m.labels.items()))): m.value
        for f in text_string_to_metric_families(text)
        for m in f.samples
    }
    assert values[("kvfleet_operator_reconciles_total", (("result", "ok"),))] >= 2
    assert values[("kvfleet_operator_inferenceservices", ())] == len(_example_services())
    assert values[("kvfleet_operator_cache_reads_total", ())] > 0
    assert values[("kvfleet_operator_api_requests_total", (("verb", "POST"),))] > 0
    assert ("kvfleet_operator_reconcile_duration_seconds_count", ()) in values


async def key_management(cluster: LocalCluster, gateway: str) -> None:
    """`kvfleet keys` changes the Secret; the running gateway follows without a restart."""
    kvfleet = str(Path(sys.executable).parent / "kvfleet")
    code, out, err = await run(cluster, kvfleet, "keys", "list", "--service", "mistral")
    assert code == 0, err
    assert [line.split()[:2] for line in out.splitlines()[1:]] == [
        ["search-team", "1"],
        ["chat-app", "1"],
    ]
    # The limits in force, each with its source (not a Python dict, not `<defaults>`).
    assert "120 requests/min (defaults), max_tokens <= 2,048 (defaults)" in out, out
    assert "60 requests/min (secret), max_tokens <= 2,048 (defaults), 1,000,000 tokens" in out

    async def status_with(key: str) -> int:
        body = {"model": "mistral-7b", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}  # fmt: skip
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{gateway}/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {key}"}) as r,
        ):  # fmt: skip
            return r.status

    # The Secret came from `kubectl apply -f examples/`: a re-apply would erase a key written
    # into it, so the CLI refuses (and writes nothing) unless told --force.
    create = ("keys", "create", "--tenant", "new-team", "--service", "mistral")
    code, out, err = await run(cluster, kvfleet, *create)
    assert code == 1 and not out and "kept by kubectl apply" in err and "--force" in err, err
    code, new_key, err = await run(cluster, kvfleet, *create, "--force")
    assert code == 0 and new_key.startswith("kvf-") and "shown once" in err, err
    new_key = new_key.strip()
    await until(lambda: _is(status_with(new_key), 200), 20, "the gateway to accept the new key")
    code, out, err = await run(cluster, kvfleet, "keys", "rotate", "--tenant", "search-team",
                               "--secret", "ai-api-keys", "--force")  # fmt: skip
    assert code == 0, err
    rotated = out.strip()
    await until(lambda: _is(status_with("foo"), 401), 20, "the rotated-out key refused")
    assert await status_with(rotated) == 200
    code, _, err = await run(cluster, kvfleet, "keys", "revoke", "--tenant", "new-team", "--all",
                             "--service", "mistral", "--force")  # fmt: skip
    assert code == 0, err
    await until(lambda: _is(status_with(new_key), 401), 20, "the revoked key refused")
    # Bad input changes nothing and says what to do.
    code, _, err = await run(cluster, kvfleet, "keys", "revoke", "--tenant", "nobody", "--all",
                             "--service", "mistral", "--force")  # fmt: skip
    assert code == 1 and "no tenant 'nobody'" in err
    assert await status_with(rotated) == 200


def _example_services() -> dict[str, str]:
    """The InferenceServices of examples/: name → served model."""
    return {
        d["metadata"]["name"]: d["spec"]["model"]["name"]
        for f in sorted((ROOT / "examples").glob("*.yaml"))
        for d in yaml.safe_load_all(f.read_text())
        if d and d.get("kind") == "InferenceService"
    }


async def every_example_serves(cluster: LocalCluster) -> None:
    """Each InferenceService of examples/ becomes Ready (the autoscaled one only once its
    gateways reach the Redis of examples/redis.yaml by its Service name) and answers a chat
    through its own gateway pod, with the sample key of examples/api-keys-secret.yaml and
    the OpenAI SDK. No container waits on a Secret, ConfigMap or claim the examples lack."""
    kc = cluster.kubeconfig
    in_files = _example_services()
    assert "deepseek-v3" in in_files and len(in_files) >= 7, in_files
    start = time.monotonic()
    for name in in_files:
        left = max(1, int(READY_WITHIN_S - (time.monotonic() - start)))
        out = await kubectl(
            kc, "wait", "--for=condition=Ready", f"kis/{name}", "-n", "ai", f"--timeout={left}s"
        )
        assert "condition met" in out
    for name, model in in_files.items():
        selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=gateway"

        async def ready_gateway(selector: str = selector) -> str | None:
            # (Ready follows the gateway Deployment's status, which a probe can lead or lag.)
            listed = await kubectl(kc, "get", "pods", "-n", "ai", "-l", selector, "-o", "json")
            ready = [p for p in json.loads(listed)["items"] if pod_ready(p)]
            return str(ready[0]["status"]["podIP"]) if ready else None

        ip = await until(
            ready_gateway, 30, f"a ready gateway pod of {name}", interval=KUBECTL_POLL_S
        )
        client = openai.AsyncOpenAI(base_url=f"http://{ip}:8080/v1", api_key="foo", max_retries=0)
        try:
            reply = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        finally:
            await client.close()
        assert reply.usage is not None and reply.usage.completion_tokens == 4, (name, reply)
    # The multi-node replica is a group the real LWS controller made: a leader and a worker,
    # each a running engine process on a node of its own.
    lws = json.loads(await kubectl(kc, "get", "lws", "deepseek-v3-engine", "-n", "ai", "-o",
                                   "json"))  # fmt: skip
    assert lws["status"]["readyReplicas"] == 1, lws["status"]
    group_of = "leaderworkerset.sigs.k8s.io/name=deepseek-v3-engine"
    listed = await kubectl(kc, "get", "pods", "-n", "ai", "-l", group_of, "-o", "json")
    group = json.loads(listed)["items"]
    assert len(group) == 2 and all(pod_ready(p) for p in group), group
    assert len({p["spec"]["nodeName"] for p in group}) == 2
    pods = json.loads(await kubectl(kc, "get", "pods", "-n", "ai", "-o", "json"))["items"]
    waiting = [
        (p["metadata"]["name"], s["state"]["waiting"]["reason"])
        for p in pods
        for s in (p.get("status") or {}).get("containerStatuses") or []
        if "waiting" in s.get("state", {})
    ]
    assert not waiting, waiting
    # Its budget store gone, the autoscaled example (every tenant budgeted) is not Ready.
    await kubectl(kc, "scale", "statefulset/redis", "-n", "ai", "--replicas=0")
    await kubectl(kc, "wait", "--for=condition=Ready=false", "kis/llama-8b", "-n", "ai",
                  "--timeout=60s")  # fmt: skip
    live = json.loads(await kubectl(kc, "get", "kis", "llama-8b", "-n", "ai", "-o", "json"))
    ready = next(c for c in live["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "GatewayUnavailable" and "limitsStore" in ready["message"], ready
    await kubectl(kc, "scale", "statefulset/redis", "-n", "ai", "--replicas=1")
    await kubectl(kc, "wait", "--for=condition=Ready", "kis/llama-8b", "-n", "ai",
                  "--timeout=60s")  # fmt: skip


async def _is(value: Any, wanted: int) -> bool:
    return bool(await value == wanted)


def granted(rbac: Path) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the operator's ClusterRole grants."""
    role = next(d for d in yaml.safe_load_all(rbac.read_text()) if d and d["kind"] == "ClusterRole")
    return {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


async def a_missing_secret_is_named(k: Any) -> None:
    """A service whose key Secret does not exist: its Ready condition names the Secret (read
    from the kubelet's FailedMount Event, under the operator's role); then it is deleted."""
    doc = yaml.safe_load((ROOT / "examples" / "mistral-7b-manual.yaml").read_text())
    doc["metadata"]["name"] = "nokeys"
    doc["spec"]["replicas"] = 1
    doc["spec"]["gateway"]["apiKeysSecret"] = "nokeys-keys"
    await k("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    out = await k(
        "wait", "--for=jsonpath={.status.conditions[?(@.type=='Ready')].reason}=ReferenceNotFound",
        "kis/nokeys", "-n", "ai", "--timeout=60s",
    )  # fmt: skip
    assert "condition met" in out
    message = await k(
        "get", "kis", "nokeys", "-n", "ai",
        "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].message}",
    )  # fmt: skip
    assert 'secret "nokeys-keys" not found' in message, message
    await k("delete", "kis", "nokeys", "-n", "ai", "--wait=false")


# Every example at once: some 25 pods start together, each a Python process whose startup
# does not shrink with the cluster's time scale (its probes do): 77 s on CI, 120 s on a
# slower machine of the same kind; 140-205 s in `make test`. It shares one xdist worker with
# the install page's story (test_install_docs.py), not with the README walkthrough: the two
# longest stories run side by side on separate workers. Each step keeps its own deadline, so
# this bound is only the backstop.
@pytest.mark.xdist_group("real-cluster-stories")
@pytest.mark.timeout(360)
async def test_the_operator_runs_from_the_manifests_under_its_service_account(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    kc = cluster.kubeconfig

    async def k(*args: str, stdin: str | None = None) -> str:
        return await kubectl(kc, *args, stdin=stdin)

    await k("apply", "-k", str(ROOT / "manifests"))
    out = await k(
        "rollout", "status", "deployment/kvfleet-operator", "-n", "kvfleet-system", "--timeout=60s"
    )
    assert "successfully rolled out" in out
    # `kubectl apply -f examples/` as a newcomer would: every example, as written.
    await k("apply", "-f", str(ROOT / "examples"))
    await every_example_serves(cluster)

    # `kubectl wait` on the InferenceService's condition, as a pipeline would.
    out = await k("wait", "--for=condition=Ready", "kis/mistral", "-n", "ai", "--timeout=120s")
    assert "condition met" in out
    pods = json.loads(
        await k("get", "pods", "-n", "ai", "-l", "app.kubernetes.io/instance=mistral", "-o", "json")
    )["items"]
    gateway = next(
        p for p in pods if p["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"
    )
    body = {"model": "mistral-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"http://{gateway['status']['podIP']}:8080/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer foo"},
        ) as r,
    ):
        assert r.status == 200, await r.text()
        assert (await r.json())["usage"]["completion_tokens"] == 4

    # The admin CLI, as `kvfleet ...` and as the kubectl plugin, on what is running.
    await k(
        "wait", "--for=jsonpath={.status.readyReplicas}=2", "kis/mistral", "-n", "ai",
        "--timeout=60s",
    )  # fmt: skip
    await admin_cli(cluster)
    await operator_metrics(cluster)
    # Argo CD's health check (docs/argocd/) on the status the operator wrote.
    live = json.loads(await k("get", "kis", "mistral", "-n", "ai", "-o", "json"))
    assert health(live) == ("Healthy", "2/2 engine replicas ready")
    live["metadata"]["generation"] += 1  # an edit the operator has not seen yet
    assert health(live)[0] == "Progressing"
    await key_management(cluster, f"http://{gateway['status']['podIP']}:8080")
    await a_missing_secret_is_named(k)

    # The autoscaled service: a model-cache claim and a warm spare labelled by the operator.
    async def warm_spare() -> bool:
        out = await k("get", "pods", "-n", "ai", "-l", "kvfleet.dev/role=warm", "-o", "name")
        return bool(out.strip())

    await until(warm_spare, 60, "a warm replica of llama-8b", interval=KUBECTL_POLL_S)
    assert "llama-8b" in await k("get", "pvc", "-n", "ai", "-o", "name")

    # Drift on every kind of child is put back (each kind's patch verb), ...
    for kind in CHILD_KINDS:
        await k(
            "label", "--overwrite", kind, "-n", "ai", "-l", "kvfleet.dev/inferenceservice",
            "app.kubernetes.io/name=tampered",
        )  # fmt: skip

    async def repaired() -> bool:
        for kind in CHILD_KINDS:
            out = await k(
                "get", kind, "-n", "ai", "-l", "app.kubernetes.io/name=tampered", "-o", "name"
            )
            if out.strip():
                return False
        return True

    await until(repaired, 60, "the operator to undo the drift", interval=KUBECTL_POLL_S)
    # ... and what a new spec no longer renders is deleted (each kind's delete verb).
    await k(
        "patch", "kis", "mistral", "-n", "ai", "--type=merge",
        "-p", json.dumps({"spec": {"gateway": {"enabled": False}}}),
    )  # fmt: skip

    async def gateway_gone() -> bool:
        out = await k(
            "get", "deployments,services,serviceaccounts,roles,rolebindings,networkpolicies,"
            "podmonitors", "-n", "ai",
            "-l", "app.kubernetes.io/instance=mistral,app.kubernetes.io/component=gateway",
            "-o", "name",
        )  # fmt: skip
        return not out.strip()

    await until(
        gateway_gone, 60, "mistral's gateway children to be deleted", interval=KUBECTL_POLL_S
    )
    # ... and the service put behind a shared gateway: the InferenceGateway's watch, its
    # children and its status.
    front = {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceGateway",
        "metadata": {"name": "front", "namespace": "ai"},
        "spec": {"apiKeysSecret": "ai-api-keys"},
    }
    await k("apply", "-f", "-", stdin=yaml.safe_dump(front))
    await k(
        "patch", "kis", "mistral", "-n", "ai", "--type=merge",
        "-p", json.dumps({"spec": {"gateway": {"enabled": True, "inferenceGateway": "front"}}}),
    )  # fmt: skip

    async def fronted() -> bool:
        out = await k("get", "kig", "front", "-n", "ai", "-o", "jsonpath={.status.models}")
        return "mistral-7b" in out

    await until(fronted, 60, "the shared gateway to serve mistral's model", interval=KUBECTL_POLL_S)
    # A multi-node service moved to one node (H200s hold DeepSeek-V3 on eight GPUs): its
    # LeaderWorkerSet goes, a Deployment takes its place.
    await k(
        "patch", "kis", "deepseek-v3", "-n", "ai", "--type=merge",
        "-p", json.dumps({"spec": {"engine": {"nodesPerReplica": 1, "gpuType": "h200"}}}),
    )  # fmt: skip

    async def one_node() -> bool:
        lws = await k("get", "lws", "-n", "ai", "-o", "name")
        dep = await k("get", "deployments", "-n", "ai", "-o", "name")
        return not lws.strip() and "deployment.apps/deepseek-v3-engine" in dep

    await until(
        one_node,
        60,
        "deepseek-v3's LeaderWorkerSet replaced by a Deployment",
        interval=KUBECTL_POLL_S,
    )

    # Every request of the operator pod was its service account's, and RBAC allowed each.
    # (The API server's own audit log.)
    # A watch is logged when its response starts (it completes only when it ends); a create by
    # server-side apply is a patch answered 201, authorized as a create too.
    records = [
        e
        for e in AuditLog(tmp_path / AUDIT_LOG, from_start=True).events()
        if e["user"]["username"] == OPERATOR and e.get("objectRef")
    ]
    assert records, "the operator pod made no request as its service account"
    denied = [e for e in records if (e.get("responseStatus") or {}).get("code") == 403]
    assert not denied, [(e["verb"], e["requestURI"]) for e in denied]
    used = set()
    for e in records:
        ref = e["objectRef"]
        resource = (
            f"{ref['resource']}/{ref['subresource']}" if ref.get("subresource") else ref["resource"]
        )
        used.add((ref.get("apiGroup", ""), resource, e["verb"]))
        if e["verb"] == "patch" and (e.get("responseStatus") or {}).get("code") == 201:
            used.add((ref.get("apiGroup", ""), resource, "create"))
    owned = json.loads(
        await k(
            "get",
            "deployment",
            "-n",
            "ai",
            "llama-8b-engine",
            "-o",
            "json",
            "--show-managed-fields",
        )
    )
    assert "kvfleet-operator" in {e["manager"] for e in owned["metadata"]["managedFields"]}
    unused = granted(ROOT / "manifests" / "base" / "rbac.yaml") - used
    assert not unused, f"granted but never used by the operator: {sorted(unused)}"
