"""A service claiming a name another already serves on a shared InferenceGateway, with the
real operator on the local cluster: the later service alone is left out (a Routed=False
condition and a Warning Event on it name the conflict), while services created after it are
still added; once the conflict is gone it is served."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import yaml

from kvfleet_operator.kube import EVENT, IGW, ISVC, SECRET
from kvfleet_operator.status import ROUTED
from tests.support.cluster import Env, OperatorFactory
from tests.support.objects import condition, isvc
from tests.support.waiting import until


def shared_gateway(ns: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceGateway",
        "metadata": {"name": "shared", "namespace": ns},
        "spec": {"insecureNoAuth": True},
    }


def behind_gateway(
    ns: str, name: str, model: str, aliases: list[str] | None = None
) -> dict[str, Any]:
    source = {"huggingFace": "meta-llama/Llama-3.1-8B-Instruct"}
    return isvc(
        name,
        ns,
        model={"name": model, "aliases": aliases or [], "source": source},
        gateway={"inferenceGateway": "shared"},
        replicas=1,
    )


def served_pools(env: Env) -> list[str]:
    secret = env.kube.get(SECRET, env.ns, "shared-pools") or {}
    text = base64.b64decode((secret.get("data") or {}).get("pools.yaml", "")).decode()
    return sorted(p["name"] for p in (yaml.safe_load(text) or {}).get("pools") or [])


def routed(env: Env, name: str) -> dict[str, Any]:
    return condition(env.kube.get(ISVC, env.ns, name), ROUTED)


async def test_a_later_service_claiming_a_served_name_is_left_out_alone(
    local_cluster: Env, operator_factory: OperatorFactory
) -> None:
    env, k, ns = local_cluster, local_cluster.kube, local_cluster.ns
    await operator_factory()
    await asyncio.to_thread(k.create, shared_gateway(ns))
    await asyncio.to_thread(k.create, behind_gateway(ns, "z-first", "alpha"))
    await until(lambda: served_pools(env) == [f"{ns}/z-first"], what="z-first served")
    await asyncio.sleep(1.1)  # creationTimestamp counts seconds: the next one is later
    # Named to sort first: the creation time, not the name, decides who keeps "alpha".
    await asyncio.to_thread(k.create, behind_gateway(ns, "a-later", "beta", ["alpha"]))
    await asyncio.to_thread(k.create, behind_gateway(ns, "m-next", "gamma"))
    await until(
        lambda: served_pools(env) == [f"{ns}/m-next", f"{ns}/z-first"],
        what="m-next added beside z-first, a-later left out",
    )
    conflict = await until(
        lambda: (c := routed(env, "a-later")).get("status") == "False" and c,
        what="a-later's Routed condition",
    )
    assert conflict["reason"] == "NameConflict"
    assert "'alpha'" in conflict["message"] and "z-first" in conflict["message"]
    # The gateway's pools and each service's status are written apart: m-next can be served
    # a moment before its own Routed condition says so.
    for name in ("z-first", "m-next"):
        await until(
            lambda name=name: routed(env, name).get("status") == "True", what=f"{name} Routed"
        )

    def warned() -> bool:
        return any(
            e["type"] == "Warning" and e["reason"] == "NameConflict"
            and e["involvedObject"]["name"] == "a-later" and "'alpha'" in e["message"]
            for e in k.list(EVENT, ns)
        )  # fmt: skip

    await until(warned, what="a Warning Event on a-later naming the conflict")
    gateway = (await asyncio.to_thread(k.get, IGW, ns, "shared"))["status"]
    assert gateway["services"] == ["m-next", "z-first"]
    assert any(s.startswith("a-later: model name 'alpha'") for s in gateway["leftOut"])

    # Its own reconcile (resyncs, children's events) keeps the condition the gateway wrote.
    await asyncio.sleep(1.0)
    assert (await asyncio.to_thread(routed, env, "a-later"))["reason"] == "NameConflict"

    patch = {"spec": {"model": {"aliases": ["alpha-2"]}}}
    await asyncio.to_thread(k.patch, ISVC, ns, "a-later", patch)
    await until(
        lambda: served_pools(env) == [f"{ns}/a-later", f"{ns}/m-next", f"{ns}/z-first"],
        what="a-later served once its alias no longer conflicts",
    )
    await until(lambda: routed(env, "a-later").get("status") == "True", what="a-later Routed")
