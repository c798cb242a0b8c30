"""The engine: one Deployment whose every pod is one SGLang replica, and its command line.

Each pod asks for `tensorParallel` GPUs, runs `python3 -m sglang.launch_server` with flags
from the spec (always `--host 0.0.0.0 --port 30000 --enable-metrics`), is gated by a startup
probe sized for minutes of model load, and drains for `terminationGracePeriodSeconds`.
"""

from __future__ import annotations

import base64
import json
import math

from kvfleet_kernel.schema import Json
from kvfleet_operator.render.common import (
    ENGINE,
    ENGINE_KEY_KEY,
    ENGINE_PORT,
    KV_EVENTS_PORT,
    KV_REPLAY_PORT,
    PREFILL,
    RESTRICTED_CONTAINER,
    ROLE_LABEL,
    Owner,
    merge_resources,
)
from kvfleet_operator.spec import (
    ENGINE_IMAGE,
    GPU_PRODUCT_LABEL,
    GPU_PRODUCTS,
    Disaggregation,
    EngineSpec,
    InferenceServiceSpec,
)
from kvfleet_operator.spec_argv import OPERATOR_ENV
from kvfleet_operator.spec_weights import LoraAdapter, LoraSpec


def engine_key_secret(owner: Owner) -> Json:
    """The Secret holding the engines' API key (`Owner.engine_key`)."""
    value = base64.b64encode(owner.engine_key.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": owner.metadata(owner.engine_key_secret, ENGINE),
        "type": "Opaque",
        "data": {ENGINE_KEY_KEY: value},
    }


MODEL_MOUNT = "/models"
CACHE_MOUNT = "/cache"
ENGINE_KEY_ENV = OPERATOR_ENV[0]
"""Hugging Face cache (HF_HOME): the shared model-cache PVC, or a per-pod emptyDir."""
STARTUP_PERIOD_S = 10
PRE_STOP_S = 10
"""Time for gateways to see the pod leave before the engine stops taking requests."""
EVENTS_PAGE_SIZE = 16
"""--page-size when KV events are on and engine.pageSize is unset (see its description)."""
KV_EVENTS_TOPIC = "kv-events"
DIST_INIT_PORT = 20000
"""Multi-node: where the group's leader listens for its workers (SGLang's --dist-init-addr)."""
LWS_LEADER_ADDRESS, LWS_WORKER_INDEX = OPERATOR_ENV[3], OPERATOR_ENV[4]
"""Set in every pod of a LeaderWorkerSet group by LeaderWorkerSet itself: the leader's DNS
name (`<set>-<group>.<set>.<namespace>`) and the pod's index in its group (0: the leader)."""


def kv_events_config() -> str:
    """SGLang's --kv-events-config: publish on every interface (the gateways connect), keep
    a replay buffer for a gateway that reconnects or misses a batch."""
    return json.dumps(
        {
            "publisher": "zmq",
            "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
            "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}",
            "topic": KV_EVENTS_TOPIC,
        },
        separators=(",", ":"),
    )


def uses_kv_events(spec: InferenceServiceSpec) -> bool:
    return spec.gateway.enabled and spec.gateway.prefix_index == "events"


def literal(value: str) -> str:
    """A spec author's string as the kubelet must pass it: every `$` doubled, so `$(VAR)` is
    never expanded (the kubelet reads `$$` as `$`). Only the operator's own references
    (`$(KVFLEET_ENGINE_API_KEY)`, LeaderWorkerSet's) reach the kubelet unescaped."""
    return value.replace("$", "$$")


def model_path(spec: InferenceServiceSpec) -> str:
    src = spec.model.source
    if src.hugging_face:
        return src.hugging_face
    if src.pvc:
        return f"{MODEL_MOUNT}/{src.pvc.path.strip('/')}".rstrip("/")
    assert src.uri is not None  # the spec's CEL rule: exactly one source
    return src.uri


def engine_args(spec: InferenceServiceSpec, component: str = ENGINE) -> list[str]:
    """SGLang server flags for one replica (`python3 -m sglang.launch_server ARGS`); with
    disaggregation, of a decode engine (`component` ENGINE) or a prefill engine (PREFILL)."""
    e: EngineSpec = spec.engine
    args = [
        "--model-path",
        literal(model_path(spec)),
        "--served-model-name",
        literal(spec.model.name),
        "--host",
        "0.0.0.0",
        "--port",
        str(ENGINE_PORT),
        "--enable-metrics",
        "--tp-size",
        str(e.tensor_parallel * e.nodes_per_replica // e.pipeline_parallel),
        "--schedule-policy",
        e.schedule_policy,
        "--kv-cache-dtype",
        e.kv_cache_dtype,
    ]
    optional = [
        ("--revision", spec.model.revision),
        ("--context-length", e.context_length),
        ("--mem-fraction-static", e.mem_fraction_static),
        ("--max-running-requests", e.max_running_requests),
        ("--chunked-prefill-size", e.chunked_prefill_size),
        ("--quantization", e.quantization),
        ("--page-size", e.page_size or (EVENTS_PAGE_SIZE if uses_kv_events(spec) else None)),
    ]
    if e.speculative:
        s = e.speculative
        optional += [
            ("--speculative-algorithm", s.algorithm),
            ("--speculative-draft-model-path", s.draft_model),
            ("--speculative-num-steps", s.num_steps),
            ("--speculative-eagle-topk", s.eagle_topk),
            ("--speculative-num-draft-tokens", s.num_draft_tokens),
        ]
    for flag, value in optional:
        if value is not None:
            args += [flag, literal(str(value))]
    if e.pipeline_parallel > 1:
        args += ["--pp-size", str(e.pipeline_parallel)]
    if e.nodes_per_replica > 1:
        # One command line for every pod of the group; the kubelet expands LWS's variables.
        args += [
            "--nnodes",
            str(e.nodes_per_replica),
            "--node-rank",
            f"$({LWS_WORKER_INDEX})",
            "--dist-init-addr",
            f"$({LWS_LEADER_ADDRESS}):{DIST_INIT_PORT}",
        ]
    if spec.disaggregation is not None:
        args += disaggregation_args(spec.disaggregation, component)
    if not e.radix_cache:
        args.append("--disable-radix-cache")
    if uses_kv_events(spec):
        args += ["--kv-events-config", kv_events_config()]
    if spec.lora is not None:
        args += lora_args(spec.lora)
    if spec.model.trust_remote_code:
        args.append("--trust-remote-code")
    args += ["--api-key", f"$({ENGINE_KEY_ENV})"]  # the kubelet expands it from the env
    return args + [literal(a) for a in e.extra_args]


LORA_MOUNT = "/lora"
"""Where adapters on PersistentVolumeClaims are mounted: /lora/<claim>/<path>."""


def adapter_path(adapter: LoraAdapter) -> str:
    """SGLang's lora_path of an adapter: a Hugging Face repo (the engine downloads it), the
    mounted claim's directory, or the URI."""
    src = adapter.source
    if src.hugging_face:
        return src.hugging_face
    if src.pvc:
        return f"{LORA_MOUNT}/{src.pvc.claim_name}/{src.pvc.path.strip('/')}".rstrip("/")
    assert src.uri is not None
    return src.uri


def lora_args(lora: LoraSpec) -> list[str]:
    """SGLang's LoRA flags: preloaded adapters in --lora-paths (NAME=PATH), the others loaded
    by the gateway on demand."""
    args = ["--enable-lora", "--max-loras-per-batch", str(lora.max_loras_per_batch)]
    if lora.max_lora_rank is not None:
        args += ["--max-lora-rank", str(lora.max_lora_rank)]
    if lora.max_loaded_loras is not None:
        args += ["--max-loaded-loras", str(lora.max_loaded_loras)]
    if lora.target_modules:
        args += ["--lora-target-modules", *map(literal, lora.target_modules)]
    preload = [literal(f"{a.name}={adapter_path(a)}") for a in lora.adapters if a.preload]
    if preload:
        args += ["--lora-paths", *preload]
    return args


def disaggregation_args(d: Disaggregation, component: str) -> list[str]:
    """SGLang's PD flags: the mode, how KV moves, where prefill engines offer it."""
    mode = "prefill" if component == PREFILL else "decode"
    args = ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", d.transfer_backend]
    if mode == "prefill":
        args += ["--disaggregation-bootstrap-port", str(d.bootstrap_port)]
    if d.ib_device:
        args += ["--disaggregation-ib-device", literal(d.ib_device)]
    return args


def _ports(spec: InferenceServiceSpec, component: str = ENGINE) -> list[Json]:
    ports: list[Json] = [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}]
    if spec.disaggregation is not None and component == PREFILL:
        port = spec.disaggregation.bootstrap_port
        ports.append({"name": "bootstrap", "containerPort": port, "protocol": "TCP"})
    if uses_kv_events(spec):
        ports += [
            {"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
            {"name": "kv-replay", "containerPort": KV_REPLAY_PORT, "protocol": "TCP"},
        ]
    if spec.engine.nodes_per_replica > 1:
        ports.append({"name": "dist-init", "containerPort": DIST_INIT_PORT, "protocol": "TCP"})
    return ports


def hf_token_env(spec: InferenceServiceSpec) -> list[Json]:
    """HF_TOKEN from `model.hfTokenSecret`, for whatever downloads from the Hub."""
    ref = spec.model.hf_token_secret
    if ref is None:
        return []
    key_ref = {"secretKeyRef": {"name": ref.name, "key": ref.key}}
    return [{"name": OPERATOR_ENV[2], "valueFrom": key_ref}]


def _engine_key_env(owner: Owner) -> list[Json]:
    """The engines' API key from its Secret, for `--api-key $(KVFLEET_ENGINE_API_KEY)`."""
    ref = {"secretKeyRef": {"name": owner.engine_key_secret, "key": ENGINE_KEY_KEY}}
    return [{"name": ENGINE_KEY_ENV, "valueFrom": ref}]


def _env(spec: InferenceServiceSpec) -> list[Json]:
    env: list[Json] = [{"name": OPERATOR_ENV[1], "value": CACHE_MOUNT}, *hf_token_env(spec)]
    for var in spec.engine.env:
        item: Json = {"name": var.name}
        if var.value_from is not None:
            item["valueFrom"] = var.value_from
        elif var.value:  # an empty value is no value to the API server (omitempty)
            item["value"] = literal(var.value)
        env.append(item)
    return env


def _volumes(owner: Owner) -> tuple[list[Json], list[Json]]:
    spec = owner.spec
    volumes: list[Json] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.engine.shm_size}}
    ]
    mounts: list[Json] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    cache = spec.model_cache
    if cache is None:
        volumes.append({"name": "model-cache", "emptyDir": {}})
    else:
        claim = cache.claim_name or f"{owner.name}-model-cache"
        volumes.append({"name": "model-cache", "persistentVolumeClaim": {"claimName": claim}})
    mounts.append({"name": "model-cache", "mountPath": CACHE_MOUNT})
    if spec.model.source.pvc:
        pvc = spec.model.source.pvc
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": True},
            }
        )
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    claims = sorted({a.source.pvc.claim_name for a in (spec.lora.adapters if spec.lora else ())
                     if a.source.pvc is not None})  # fmt: skip
    for i, claim in enumerate(claims):
        volumes.append(
            {"name": f"lora-{i}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        )
        mounts.append({"name": f"lora-{i}", "mountPath": f"{LORA_MOUNT}/{claim}",
                       "readOnly": True})  # fmt: skip
    return volumes, mounts


def _probe(path: str, period: int, failures: int, timeout: int) -> Json:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
        "successThreshold": 1,
    }


def engine_pod_spec(owner: Owner, component: str = ENGINE) -> Json:
    spec = owner.spec
    e = spec.engine
    tp = str(e.tensor_parallel)
    volumes, mounts = _volumes(owner)
    # A bound on host memory (a runaway engine must not take the node), with room for loading
    # weights through host memory: twice the default request, or the request a user set.
    memory_limit = e.resources.requests.get("memory", f"{64 * e.tensor_parallel}Gi")
    resources = merge_resources(
        {
            "requests": {
                "cpu": str(4 * e.tensor_parallel),
                "memory": f"{32 * e.tensor_parallel}Gi",
                "nvidia.com/gpu": tp,
            },
            "limits": {"memory": memory_limit, "nvidia.com/gpu": tp},
        },
        e.resources.requests,
        e.resources.limits,
    )
    resources["requests"]["nvidia.com/gpu"] = resources["limits"]["nvidia.com/gpu"] = tp
    d = spec.disaggregation
    if d is not None and d.ib_device and d.rdma_resource:  # the NIC the KV crosses
        resources["requests"][d.rdma_resource] = resources["limits"][d.rdma_resource] = "1"
    container: Json = {
        "name": "sglang",
        # Not defaulted in the CRD: an unset image follows the operator's release.
        "image": e.image or ENGINE_IMAGE,
        "imagePullPolicy": e.image_pull_policy,
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": engine_args(spec, component),
        "ports": _ports(spec, component),
        "env": [*_engine_key_env(owner), *_env(spec)],
        "resources": resources,
        "volumeMounts": mounts,
        "startupProbe": _probe(
            "/health", STARTUP_PERIOD_S, math.ceil(e.startup_timeout_seconds / STARTUP_PERIOD_S), 5
        ),
        "readinessProbe": _probe("/health", 5, 3, 5),
        "livenessProbe": _probe("/health", 15, 4, 10),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_S)]}}},
        # SGLang writes no termination message: the kubelet keeps its log's tail instead,
        # so a failed start (an unknown model) says why in the pod's lastState and status.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Pod Security "restricted" but for runAsNonRoot: the SGLang image runs as root
        # (Triton, NCCL and the model download cache write under /root).
        "securityContext": _container_security(spec),
    }
    node_selector = dict(spec.scheduling.node_selector)
    if e.gpu_type:
        node_selector[GPU_PRODUCT_LABEL] = GPU_PRODUCTS[e.gpu_type]
    pod: Json = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": e.termination_grace_period_seconds,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            *spec.scheduling.tolerations,
        ],
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": owner.selector(component)},
            }
        ],
    }
    if node_selector:
        pod["nodeSelector"] = node_selector
    if spec.scheduling.affinity:
        pod["affinity"] = spec.scheduling.affinity
    if spec.scheduling.priority_class_name:
        pod["priorityClassName"] = spec.scheduling.priority_class_name
    return pod


def _container_security(spec: InferenceServiceSpec) -> Json:
    """Restricted; KV over RDMA (disaggregation.ibDevice) pins memory: IPC_LOCK."""
    d = spec.disaggregation
    if d is None or not d.ib_device:
        return RESTRICTED_CONTAINER
    return {**RESTRICTED_CONTAINER, "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}


def engine_deployment(owner: Owner, replicas: int, component: str = ENGINE) -> Json:
    """The engines' Deployment; with disaggregation, the decode pool's (ENGINE) or the
    prefill pool's (PREFILL, from `prefill_owner`)."""
    e = owner.spec.engine
    # Autoscaled: a new pod starts warm and takes no traffic until the operator admits it
    # (promotes it); manual: every ready pod serves, whether the operator runs or not.
    # (A prefill pool's owner carries the prefill pool's own autoscaling: `prefill_owner`.)
    role = "warm" if owner.spec.autoscaling is not None else "active"
    labels = {**owner.labels(component), ROLE_LABEL: role}
    name = owner.engine_name if component == ENGINE else owner.prefill_name
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": owner.metadata(name, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": owner.selector(component)},
            # One new replica before an old one goes: no capacity dip, one spare GPU set.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "progressDeadlineSeconds": e.startup_timeout_seconds + 600,
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(ENGINE_PORT),
                        "prometheus.io/path": "/metrics",
                        **owner.engine_key_annotations(),
                    },
                },
                "spec": engine_pod_spec(owner, component),
            },
        },
    }


def model_cache_pvc(owner: Owner) -> Json | None:
    cache = owner.spec.model_cache
    if cache is None or cache.size is None:
        return None
    spec: Json = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name:
        spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": owner.metadata(f"{owner.name}-model-cache", ENGINE),
        "spec": spec,
    }
