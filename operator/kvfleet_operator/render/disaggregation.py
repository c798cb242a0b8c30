"""Prefill/decode disaggregation: a prefill pool beside the engines, which become the decode
pool.

The prefill engines are the engines' pods with the prefill pool's GPUs (`tensorParallel`,
`gpuType` overrides), SGLang's `--disaggregation-mode prefill` and the bootstrap port
declared; the decode engines run `--disaggregation-mode decode` and keep every other trait of
the engine workload (autoscaling, warm pool, multi-node groups). The gateway pairs them per
request. The NetworkPolicies (`network.py`) let this service's prefill and decode pods reach
each other on any port — a decode engine collects KV from the bootstrap port, and the
transfer engine's side channels (Mooncake, NIXL) use ports they pick at run time; RDMA
traffic itself never crosses a NetworkPolicy — and nothing else but the gateway and scrapers.
"""

from __future__ import annotations

import dataclasses

from kvfleet_kernel.schema import Json
from kvfleet_operator.render.common import PREFILL, Owner
from kvfleet_operator.render.engine import engine_deployment


def prefill_owner(owner: Owner) -> Owner:
    """The owner as the prefill pool's renderers and scalers see it: its engine (one node per
    replica), its replicas or autoscaling."""
    d = owner.spec.disaggregation
    assert d is not None
    e = owner.spec.engine
    engine = dataclasses.replace(
        e,
        tensor_parallel=d.prefill.tensor_parallel or e.tensor_parallel,
        gpu_type=d.prefill.gpu_type or e.gpu_type,
        nodes_per_replica=1,
        pipeline_parallel=1,
        extra_args=e.extra_args if d.prefill.extra_args is None else d.prefill.extra_args,
        resources=e.resources if d.prefill.resources is None else d.prefill.resources,
    )
    spec = dataclasses.replace(
        owner.spec, engine=engine, replicas=d.prefill.replicas, autoscaling=d.prefill.autoscaling
    )
    return dataclasses.replace(owner, spec=spec)


def prefill_deployment(owner: Owner, replicas: int) -> Json:
    """The prefill pool's Deployment (`owner`: the service; `replicas`: decided)."""
    return engine_deployment(prefill_owner(owner), replicas, PREFILL)
