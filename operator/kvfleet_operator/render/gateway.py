"""The gateway: config (the `kvfleet_gateway.config` contract), Deployment, Service, RBAC.

The ConfigMap is built by parsing the document with `GatewayConfig.from_dict` and writing
back its `to_dict()`, so the operator can only render a config the gateway accepts; a
`ConfigError` becomes the InferenceService's `Ready=False` condition.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import yaml

from kvfleet_gateway.config import GatewayConfig
from kvfleet_kernel.schema import Json, to_json
from kvfleet_operator.gateway_spec import GatewayFront
from kvfleet_operator.render.common import (
    ENGINE_KEY_KEY,
    ENGINE_PORT,
    GATEWAY,
    GATEWAY_METRICS_PORT,
    GATEWAY_PORT,
    PREFILL,
    RESTRICTED_CONTAINER,
    ROLE_LABEL,
    GatewayOwnerLike,
    Owner,
    merge_resources,
    service,
)
from kvfleet_operator.render.engine import (
    MODEL_MOUNT,
    adapter_path,
    hf_token_env,
    literal,
    model_path,
    uses_kv_events,
)
from kvfleet_operator.spec import InferenceServiceSpec

CONFIG_DIR, KEYS_DIR = "/etc/kvfleet/config", "/etc/kvfleet/keys"
ENGINE_KEY_DIR = "/etc/kvfleet/engine-key"
REDIS_PASSWORD_DIR, REDIS_PASSWORD_KEY = "/etc/kvfleet/redis", "password"
STATE_DIR = "/var/lib/kvfleet"
"""An emptyDir: the settlement journal survives a container restart (not a pod's deletion)."""
CONFIG_KEY, KEYS_KEY = "gateway.yaml", "keys.yaml"
CONFIG_HASH = "kvfleet.dev/config-hash"
RUN_AS = 10001
TOKENIZER_DIR = "/var/lib/kvfleet-tokenizer"
"""An emptyDir the init container fills from the Hub (model.source.huggingFace)."""


def tokenizer_dir(spec: InferenceServiceSpec) -> str:
    """Where the gateway reads the model's tokenizer (prefixIndex: events): the model's own
    directory on its PVC, or what the init container fetched from the Hub."""
    return model_path(spec) if spec.model.source.pvc else TOKENIZER_DIR


def routing_priors(spec: InferenceServiceSpec) -> Json:
    """What the gateway's routing priors start from: the engines' GPU and TP size, and the
    model's config.json where the gateway has it (the model's own directory on its PVC,
    mounted for the tokenizer); elsewhere the gateway's default model, calibrated online.
    The engines' batch slots, when set, bound a replica's batch in its throughput estimate."""
    tuning: Json = {"tensorParallel": spec.engine.tensor_parallel}
    if spec.engine.gpu_type:
        tuning["gpu"] = spec.engine.gpu_type
    if spec.engine.max_running_requests:
        tuning["maxRunningRequests"] = spec.engine.max_running_requests
    if uses_kv_events(spec) and spec.model.source.pvc:
        tuning["modelConfig"] = tokenizer_dir(spec)
    return tuning


def _prefill_backends(owner: Owner) -> Json:
    """A disaggregated service's prefill pool: its pods by selector, its bootstrap port."""
    d = owner.spec.disaggregation
    if d is None:
        return {}
    selector = f"{owner.selector_string(PREFILL)},{ROLE_LABEL}=active"
    return {
        "prefill": {
            "kubernetes": {"namespace": owner.namespace, "selector": selector, "port": ENGINE_PORT},
            "bootstrapPort": d.bootstrap_port,
        }
    }


def limits_doc(g: GatewayFront, scope: str) -> Json:
    """The gateway's `limits:`: the store, every tenant's limits, and its default scope."""
    limits: Json = {
        "store": g.limits_store,
        "defaults": to_json(g.default_limits),
        "tenants": to_json(g.tenants),
        "redisOutage": {"gatewayReplicas": g.replicas},
    }
    if g.limits_store != "memory":
        limits["journal"] = f"{STATE_DIR}/settlements.jsonl"
        limits["scope"] = g.limits_scope or scope
        if g.limits_store_password is not None:
            limits["passwordFile"] = f"{REDIS_PASSWORD_DIR}/{REDIS_PASSWORD_KEY}"
    return limits


def auth_doc(g: GatewayFront) -> Json:
    auth: Json = {"insecureNoAuth": g.insecure_no_auth}
    if g.api_keys_secret:
        auth["keysFile"] = f"{KEYS_DIR}/{KEYS_KEY}"
    return auth


LISTEN: Json = {"host": "0.0.0.0", "port": GATEWAY_PORT, "metricsPort": GATEWAY_METRICS_PORT}


def pool_doc(owner: Owner, engine_key_file: str) -> Json:
    """What a gateway needs to serve this service's engines: its model (name, aliases,
    price), the engine pods by selector and their key, routing, cost, fairness, LoRA."""
    spec, g = owner.spec, owner.spec.gateway
    model: Json = {"name": spec.model.name}
    if spec.engine.context_length:
        model["contextLength"] = spec.engine.context_length
    if spec.model.aliases:
        model["aliases"] = list(spec.model.aliases)
    if spec.model.price is not None:
        model["price"] = to_json(spec.model.price)
    return {
        "models": [model],
        "backends": {
            "kubernetes": {
                "namespace": owner.namespace,
                "selector": f"{owner.replica_selector_string()},{ROLE_LABEL}=active",
                "port": ENGINE_PORT,
            },
            "engineApiKeyFile": engine_key_file,
            **_prefill_backends(owner),
        },
        "routing": {
            "policy": g.routing_policy,
            "tuning": routing_priors(spec),
            "prefixIndex": (
                {"source": "events", "tokenizer": tokenizer_dir(spec)}
                if uses_kv_events(spec)
                else {"source": "approximate"}
            ),
        },
        "cost": {
            "gpuHourlyPrice": spec.cost.gpu_hourly_price,
            "gpusPerReplica": spec.engine.tensor_parallel,
        },
        **_fairness(owner),
        **_lora(owner),
    }


def gateway_config(owner: Owner) -> GatewayConfig:
    """The gateway's config document for this service (raises ConfigError)."""
    g = owner.spec.gateway
    doc = {
        "listen": LISTEN,
        **pool_doc(owner, f"{ENGINE_KEY_DIR}/{ENGINE_KEY_KEY}"),
        "auth": auth_doc(g),
        "limits": limits_doc(g, f"{owner.namespace}/{owner.name}"),
    }
    return GatewayConfig.from_dict(doc)


def _lora(owner: Owner) -> Json:
    """The adapters the gateway routes and loads on demand, with the engines' paths."""
    lora = owner.spec.lora
    if lora is None:
        return {}
    adapters = [{"name": a.name, "path": adapter_path(a), "base": owner.spec.model.name}
                for a in lora.adapters]  # fmt: skip
    held = lora.max_loaded_loras or lora.max_loras_per_batch
    return {"lora": {"adapters": adapters, "maxAdaptersPerReplica": held}}


def _fairness(owner: Owner) -> Json:
    """The gateway's overload queue: saturation at the engines' batch slots, split between
    the gateway replicas (each counts only its own requests); without a slot count, at one
    request waiting in an engine's queue (its scraped signal)."""
    f = owner.spec.gateway.fair_sharing
    if f is None:
        return {}
    doc: Json = {"enabled": True, "maxWaiting": f.max_waiting, "timeout": f.timeout_seconds}
    slots = owner.spec.engine.max_running_requests
    if slots:
        per_gateway = math.ceil(slots / owner.spec.gateway.replicas)
        doc["maxInflightPerReplica"] = per_gateway
        doc["reservePerReplica"] = min(f.reserve_per_replica, per_gateway - 1)
    else:
        doc["queuePerReplica"] = 1
        doc["reservePerReplica"] = 0
    return {"fairness": doc}


def gateway_configmap(owner: GatewayOwnerLike, config: GatewayConfig) -> Json:
    text = yaml.safe_dump(config.to_dict(), sort_keys=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": owner.metadata(owner.gateway_name, GATEWAY),
        "data": {CONFIG_KEY: text},
    }


def gateway_deployment(owner: Owner, config: Json) -> Json:
    """This service's own gateway: its engines' key (read at start; a new key changes the
    template's annotation and rolls the gateway with the engines), and the tokenizer."""
    volumes = [{"name": "engine-key", "secret": {"secretName": owner.engine_key_secret}}]
    mounts = [{"name": "engine-key", "mountPath": ENGINE_KEY_DIR, "readOnly": True}]
    init = _tokenizer_volumes(owner, volumes, mounts)
    extra = GatewayPodExtras(volumes, mounts, init, owner.engine_key_annotations())
    return gateway_pods(owner, owner.spec.gateway, config, extra)


@dataclass(frozen=True)
class GatewayPodExtras:
    """What one kind of gateway adds to the pods every gateway has."""

    volumes: list[Json]
    mounts: list[Json]
    init_containers: list[Json]
    annotations: dict[str, str]


def gateway_pods(owner: GatewayOwnerLike, g: GatewayFront, config: Json,
                 extra: GatewayPodExtras) -> Json:  # fmt: skip
    """The gateway Deployment: config, keys, the Redis password, probes, hardening."""
    config_hash = hashlib.sha256(config["data"][CONFIG_KEY].encode()).hexdigest()[:16]
    volumes: list[Json] = [
        {"name": "config", "configMap": {"name": owner.gateway_name}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "state", "emptyDir": {}},
    ]
    mounts: list[Json] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "state", "mountPath": STATE_DIR},
    ]
    if g.api_keys_secret:
        # The gateway polls the file: a rotated Secret takes effect without a restart.
        volumes.append({"name": "keys", "secret": {"secretName": g.api_keys_secret}})
        mounts.append({"name": "keys", "mountPath": KEYS_DIR, "readOnly": True})
    if g.limits_store_password is not None:  # read at start: rotate, then restart the pods
        ref = g.limits_store_password
        items = [{"key": ref.key, "path": REDIS_PASSWORD_KEY}]
        volumes.append(
            {"name": "redis-password", "secret": {"secretName": ref.name, "items": items}}
        )
        mounts.append({"name": "redis-password", "mountPath": REDIS_PASSWORD_DIR, "readOnly": True})
    volumes += extra.volumes
    mounts += extra.mounts
    init = extra.init_containers
    probe = {"periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 3}
    container: Json = {
        "name": "gateway",
        "image": g.image or owner.gateway_image,  # unset: the operator's own (not frozen)
        "imagePullPolicy": "IfNotPresent",
        "command": ["kvfleet"],
        "args": ["gateway", "--config", f"{CONFIG_DIR}/{CONFIG_KEY}"],
        "terminationMessagePolicy": "FallbackToLogsOnError",  # why a start failed, in status
        "ports": [
            {"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": GATEWAY_METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": merge_resources(
            {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
            g.resources.requests,
            g.resources.limits,
        ),
        # Liveness starts once the process answers: a slow start is not a hang.
        "startupProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "periodSeconds": 1,
            "timeoutSeconds": 2,
            "failureThreshold": 60,
        },
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, **probe},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, **probe},
        "volumeMounts": mounts,
        "securityContext": {**RESTRICTED_CONTAINER, "readOnlyRootFilesystem": True},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": owner.metadata(owner.gateway_name, GATEWAY),
        "spec": {
            "replicas": g.replicas,
            "selector": {"matchLabels": owner.selector(GATEWAY)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": owner.labels(GATEWAY),
                    # A new config rolls the gateway (it reads its config once at start).
                    "annotations": {
                        CONFIG_HASH: config_hash,
                        **extra.annotations,
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(GATEWAY_METRICS_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "serviceAccountName": owner.gateway_name,
                    **({"initContainers": init} if init else {}),
                    "containers": [container],
                    "volumes": volumes,
                    "terminationGracePeriodSeconds": 60,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": RUN_AS,
                        "runAsGroup": RUN_AS,
                        "fsGroup": RUN_AS,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                },
            },
        },
    }


def _tokenizer_volumes(owner: Owner, volumes: list[Json], mounts: list[Json]) -> list[Json]:
    """With prefixIndex: events the gateway tokenizes prompts with the model's tokenizer:
    the model's PVC mounted read-only, or an init container that fetches it from the Hub
    (with the engines' HF token). Returns the init containers."""
    spec = owner.spec
    if not uses_kv_events(spec):
        return []
    src = spec.model.source
    if src.pvc:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": src.pvc.claim_name, "readOnly": True},
            }
        )
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
        return []
    assert src.hugging_face is not None  # the spec's CEL rule: huggingFace or pvc
    volumes.append({"name": "tokenizer", "emptyDir": {"sizeLimit": "256Mi"}})
    mounts.append({"name": "tokenizer", "mountPath": TOKENIZER_DIR, "readOnly": True})
    args = ["fetch-tokenizer", literal(src.hugging_face), "--dest", TOKENIZER_DIR]
    if spec.model.revision:
        args += ["--revision", literal(spec.model.revision)]
    return [
        {
            "name": "tokenizer",
            "image": spec.gateway.image or owner.gateway_image,
            "imagePullPolicy": "IfNotPresent",
            "command": ["kvfleet"],
            "args": args,
            **({"env": env} if (env := hf_token_env(spec)) else {}),
            "resources": {
                "requests": {"cpu": "100m", "memory": "128Mi"},
                "limits": {"memory": "512Mi"},
            },
            "volumeMounts": [{"name": "tokenizer", "mountPath": TOKENIZER_DIR}],
            "securityContext": {**RESTRICTED_CONTAINER, "readOnlyRootFilesystem": True},
        }
    ]


def gateway_service(owner: GatewayOwnerLike, g: GatewayFront) -> Json:
    return service(owner, owner.gateway_service, GATEWAY, GATEWAY_PORT, type=g.service_type)


def gateway_rbac(owner: GatewayOwnerLike) -> list[Json]:
    """The gateway may only get, list and watch pods in its own namespace."""
    name = owner.gateway_name
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": owner.metadata(name, GATEWAY),
            "automountServiceAccountToken": True,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": owner.metadata(name, GATEWAY),
            "rules": [
                # Discovery lists and watches engine pods; it never reads one by name.
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": owner.metadata(name, GATEWAY),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        },
    ]
