"""Statuses that name the cause, with the real operator on the local cluster (pods run as
processes): a keys Secret the gateway refuses, and an engine that exits at start. Each cause
was only in a pod's log; the InferenceService's conditions, `kvfleet describe` and `kvfleet
keys list` now say it."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from kvfleet_operator.kube import ISVC, Kube
from tests.support.cluster import Env
from tests.support.objects import condition, isvc
from tests.support.waiting import until

KVFLEET = str(Path(sys.executable).parent / "kvfleet")
TYPO_KEYS = (
    "tenants:\n  - name: team-a\n    keys: ['sha256:" + "0" * 64 + "']\n"
    "    limits: {requestPerMinute: 60}\n"
)


async def kvfleet(cluster: Env, *argv: str) -> tuple[int, str, str]:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    proc = await asyncio.create_subprocess_exec(
        KVFLEET, *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    return int(proc.returncode or 0), out.decode(), err.decode()


def degraded_because(k: Kube, ns: str, name: str, reason: str) -> dict[str, Any] | None:
    body = k.get(ISVC, ns, name) or {}
    cond = condition(body, "Degraded")
    return body if (cond.get("status"), cond.get("reason")) == ("True", reason) else None


def keys_secret(ns: str, text: str) -> dict[str, Any]:
    meta = {"name": "team-keys", "namespace": ns}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "stringData": {"keys.yaml": text},
    }


async def test_a_keys_typo_is_named_in_the_condition_and_marked_in_the_listing(
    operator_cluster: Env,
) -> None:
    """The gateway refuses the Secret and crash-loops; the service said GatewayUnavailable
    and Degraded=False. Now Degraded=True, InvalidKeys, naming the field; `kvfleet keys
    list` marks the entry; once the Secret is fixed the service serves."""
    k, ns = operator_cluster.kube, operator_cluster.ns
    path = f"/api/v1/namespaces/{ns}/secrets"
    await asyncio.to_thread(k.request, "POST", path, keys_secret(ns, TYPO_KEYS))
    spec = isvc("llama", ns, replicas=1, gateway={"apiKeysSecret": "team-keys"})
    await asyncio.to_thread(k.create, spec)
    body = await until(
        lambda: degraded_because(k, ns, "llama", "InvalidKeys"), 60, "Degraded=True, InvalidKeys"
    )
    said = condition(body, "Degraded")["message"]
    assert said == "secret team-keys keys.yaml: tenants[0].limits.requestPerMinute: unknown field"
    assert condition(body, "Ready")["reason"] == "InvalidKeys"
    code, out, err = await kvfleet(operator_cluster, "keys", "list", "--service", "llama")
    assert code == 0, err
    assert "INVALID limits.requestPerMinute: unknown field" in out, out
    assert "a gateway refuses this file (team-a)" in err, err
    code, out, err = await kvfleet(operator_cluster, "describe", "llama")
    assert code == 0 and "InvalidKeys" in out and "requestPerMinute" in out, (out, err)
    fixed = TYPO_KEYS.replace("requestPerMinute", "requestsPerMinute")
    await asyncio.to_thread(k.request, "PUT", f"{path}/team-keys", keys_secret(ns, fixed))
    await until(
        lambda: condition(k.get(ISVC, ns, "llama") or {}, "Ready").get("status") == "True",
        90,
        "Ready=True once the keys are fixed",
    )
    body = await asyncio.to_thread(k.get, ISVC, ns, "llama")
    assert condition(body or {}, "Degraded")["status"] == "False"


async def test_an_engine_that_exits_at_start_says_why_in_the_condition(
    operator_cluster: Env,
) -> None:
    """An unknown model: the engine exits at once, again and again. The Degraded condition
    carries the container's last termination message (its log's tail, which the engine
    container asks for with FallbackToLogsOnError), and `kvfleet describe` shows it."""
    k, ns = operator_cluster.kube, operator_cluster.ns
    model = {"name": "nope-7b", "source": {"huggingFace": "nope/nope-7b"}}
    await asyncio.to_thread(k.create, isvc("nope", ns, replicas=1, model=model))
    body = await until(
        lambda: degraded_because(k, ns, "nope", "ReplicasFailing"), 60, "Degraded=True"
    )
    said = condition(body, "Degraded")["message"]
    assert "exit code 2" in said and "unknown model 'nope/nope-7b'" in said, said
    code, out, err = await kvfleet(operator_cluster, "describe", "nope")
    assert code == 0 and "unknown model 'nope/nope-7b'" in out, (out, err)
