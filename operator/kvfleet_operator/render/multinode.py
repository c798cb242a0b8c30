"""Multi-node replicas: one LeaderWorkerSet whose every group is one SGLang replica.

A model too large for one node's GPUs (a 671B MoE on H100s) runs as `nodesPerReplica` pods
that form one engine: SGLang's `--nnodes`, `--node-rank` and `--dist-init-addr`, with the
group's GPUs split by tensor (and pipeline) parallelism. LeaderWorkerSet
(`leaderworkerset.x-k8s.io/v1`) creates each group's leader and workers together, gives them
their index and the leader's address (`LWS_WORKER_INDEX`, `LWS_LEADER_ADDRESS`), and
recreates the whole group when one of its pods fails — a replica with a lost node cannot
serve, and its survivors cannot rejoin a new peer on their own.

The pods are the single-node engine's pods: the same command line, probes and resources
per pod. Only the leader carries the role label, so the gateway (which selects
`role=active`) routes to leaders only; workers answer `/health` and nothing else.
"""

from __future__ import annotations

import copy

from kvfleet_kernel.schema import Json
from kvfleet_operator.render.common import ENGINE, ROLE_LABEL, Owner
from kvfleet_operator.render.engine import engine_deployment

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"


def engine_leader_worker_set(owner: Owner, replicas: int) -> Json:
    """The engine as LeaderWorkerSet groups: `replicas` groups of `nodesPerReplica` pods."""
    template = engine_deployment(owner, replicas)["spec"]["template"]
    worker = copy.deepcopy(template)
    del worker["metadata"]["labels"][ROLE_LABEL]  # workers are never routed to
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": owner.metadata(owner.engine_name, ENGINE),
        "spec": {
            "replicas": replicas,
            # Workers start with their leader: SGLang's ranks wait for each other anyway.
            "startupPolicy": "LeaderCreated",
            # A new group before an old one goes, as the single-node Deployment rolls.
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "leaderWorkerTemplate": {
                "size": owner.spec.engine.nodes_per_replica,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": template,
                "workerTemplate": worker,
            },
            # The group's pods find the leader as <set>-<group>.<set>: the engine Service
            # (headless, named as the set) is that subdomain.
            "networkConfig": {"subdomainPolicy": "Shared"},
        },
    }
