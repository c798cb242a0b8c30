"""The InferenceService spec: one typed model the CRD schema and the operator both come from.

Every field has exactly one default, declared here; `crd.py` renders this model as the
CRD's OpenAPI schema and `schema.parse` reads a custom resource back into it. Field docs
become the schema's descriptions (`kubectl explain kis.spec.engine`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from kvfleet_gateway.config import Price
from kvfleet_kernel.schema import Json, Rule, fld, parse
from kvfleet_operator.gateway_spec import (
    GATEWAY_KEYS_RULE,
    GatewaySpec,
    ResourceOverrides,
    SecretKey,
)
from kvfleet_operator.spec_argv import (
    FORBIDDEN_FLAGS,
    GIT_REF_PATTERN,
    MANAGED_FLAGS,
    MANAGED_RE,
    MODEL_NAME_MAX,
    MODEL_NAME_PATTERN,
    OPERATOR_ENV,
    OPERATOR_ENV_LIST,
    PATH_PATTERN,
)
from kvfleet_operator.spec_scaling import Autoscaling
from kvfleet_operator.spec_weights import LoraSpec, ModelSource

GROUP, VERSION, KIND, PLURAL = "kvfleet.dev", "v1alpha1", "InferenceService", "inferenceservices"
ENGINE_IMAGE = "lmsysorg/sglang:v0.5.23"
"""The SGLang release whose server flags the renderer emits (checked with that release's own
argument parser); pin a digest in production."""
GPU_PRODUCTS = {
    "h100": "NVIDIA-H100-80GB-HBM3",
    "h200": "NVIDIA-H200",
    "a100-80g": "NVIDIA-A100-SXM4-80GB",
    "l40s": "NVIDIA-L40S",
}
"""`gpuType` → the `nvidia.com/gpu.product` node label NVIDIA's GPU feature discovery sets."""
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"

NAME_MAX = 56
"""The longest InferenceService name: its children's names add at most `-engine` (7 characters)
and a Service's name is a DNS-1035 label of at most 63."""
NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_RULE = Rule(
    f"self.metadata.name.size() <= {NAME_MAX} && self.metadata.name.matches('{NAME_PATTERN}')",
    f"the name must be at most {NAME_MAX} characters (its children add '-engine'; a Service"
    " name is at most 63), lower-case letters, digits and '-', starting with a letter and"
    " ending with a letter or digit (a Service name is a DNS-1035 label)",
    ".metadata.name",
)


# Checked against sglang 0.5.23's `--quantization` and `--schedule-policy` choices (a subset).
Quantization = Literal[
    "fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "gguf", "bitsandbytes", "w8a8_fp8",
    "w8a8_int8", "modelopt_fp8", "modelopt_fp4", "compressed-tensors",
]  # fmt: skip
SchedulePolicy = Literal["fcfs", "lpm", "dfs-weight", "lof", "random", "priority"]


EXTRA_ARG_RULE = Rule(
    f"!self.matches('{MANAGED_RE}')",
    "extraArgs may not set flags the operator manages (see engine.extraArgs)",
)
"""On each extra argument: its estimated cost is one argument's (512 characters against the
regex), not the list's."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    RULES: ClassVar = (
        Rule("!(self.name in self.aliases)", "an alias repeats the served name", ".aliases"),
    )
    name: str = fld(
        doc="Served model name: what clients put in `model` (SGLang --served-model-name).",
        pattern=MODEL_NAME_PATTERN,
        max_length=MODEL_NAME_MAX,
    )
    source: ModelSource = fld(doc="Where the weights come from.")
    revision: str | None = fld(
        None,
        "Model revision (branch, tag or commit) to load.",
        pattern=GIT_REF_PATTERN,
        max_length=255,
    )
    trust_remote_code: bool = fld(False, "Allow custom modelling code from the model repo.")
    hf_token_secret: SecretKey | None = fld(
        None, "Secret with a Hugging Face token (HF_TOKEN) for gated models."
    )
    aliases: tuple[str, ...] = fld(
        (),
        "Other names clients may send in `model` for it (the gateway passes the served name on):"
        " the served name's pattern (no ':'), each once.",
        max_items=32,
        pattern=MODEL_NAME_PATTERN,
        max_length=MODEL_NAME_MAX,
        unique_by=".",
    )
    price: Price | None = fld(
        None,
        "What its tokens cost per million (prompt, cached prompt, output), in the currency"
        " of every model behind the same gateway: tenants' costBudget and the cost metrics"
        " count at this rate. Unset: GPU time at cost.gpuHourlyPrice.",
    )


@dataclass(frozen=True, kw_only=True)
class Speculative:
    """Speculative decoding (SGLang --speculative-*)."""

    RULES: ClassVar = (
        Rule(
            "self.algorithm == 'NGRAM' || has(self.draftModel)",
            "EAGLE and EAGLE3 need a draftModel",
            ".draftModel",
        ),
    )
    algorithm: Literal["EAGLE", "EAGLE3", "NGRAM"] = fld(doc="Speculative algorithm.")
    draft_model: str | None = fld(
        None,
        "Draft model path or Hugging Face id (EAGLE/EAGLE3).",
        pattern=PATH_PATTERN,
        max_length=512,
    )
    num_steps: int = fld(3, "Draft steps per verification.", minimum=1, maximum=16)
    eagle_topk: int = fld(1, "Branching factor of the draft tree.", minimum=1, maximum=16)
    num_draft_tokens: int = fld(4, "Draft tokens verified per step.", minimum=1, maximum=64)


@dataclass(frozen=True, kw_only=True)
class EnvVar:
    # On each variable (one variable's cost, where a rule over env would cost the list's).
    RULES: ClassVar = (
        Rule(
            f"!(self.name in {OPERATOR_ENV_LIST})",
            "env may not set a variable the operator sets: " + ", ".join(OPERATOR_ENV),
            ".name",
            message_expression="'env ' + self.name + ' is set by the operator ("
            + ", ".join(OPERATOR_ENV)
            + " are)'",
        ),
    )
    name: str = fld(doc="Variable name.", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=128)
    value: str | None = fld(
        None,
        "Literal value, passed as written: a `$` is written as `$$` for the kubelet, so"
        " `$(VAR)` is not expanded.",
        max_length=8192,
    )
    value_from: Json | None = fld(None, "A Kubernetes EnvVarSource (secretKeyRef, ...).")


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    RULES: ClassVar = (
        Rule(
            "(self.tensorParallel * self.nodesPerReplica) % self.pipelineParallel == 0",
            "pipelineParallel must divide the replica's GPUs (tensorParallel x nodesPerReplica)",
            ".pipelineParallel",
        ),
    )
    image: str | None = fld(
        None,
        f"SGLang engine image. Unset: the operator's default ({ENGINE_IMAGE} in this release),"
        " which moves with operator upgrades — set it to pin an image.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = fld(
        "IfNotPresent", "Pull policy of the engine image."
    )
    tensor_parallel: Literal[1, 2, 4, 8] = fld(
        1,
        "GPUs per pod (the pod's nvidia.com/gpu). One node per replica: SGLang's --tp-size."
        " With nodesPerReplica N, --tp-size is tensorParallel x N / pipelineParallel.",
    )
    nodes_per_replica: int = fld(
        1,
        "Pods (nodes) per replica. Above 1 each replica is a LeaderWorkerSet group (the"
        " leaderworkerset.x-k8s.io/v1 API must be installed): SGLang's --nnodes, --node-rank"
        " from the pod's worker index, --dist-init-addr at the leader; only the leader serves"
        " HTTP and only leaders are routed to; a lost pod restarts its whole group.",
        minimum=1,
        maximum=16,
    )
    pipeline_parallel: int = fld(
        1,
        "SGLang --pp-size: pipeline stages across the replica's GPUs (usually 1, or the node"
        " count when the interconnect between nodes is slow).",
        minimum=1,
        maximum=16,
    )
    gpu_type: GpuType | None = fld(
        None, "GPU model; selects nodes by the nvidia.com/gpu.product label."
    )
    resources: ResourceOverrides = fld(ResourceOverrides, "Resource overrides.")
    context_length: int | None = fld(None, "SGLang --context-length.", minimum=1)
    mem_fraction_static: float | None = fld(
        None, "SGLang --mem-fraction-static (weights + KV pool).", minimum=0.1, maximum=0.98
    )
    max_running_requests: int | None = fld(None, "SGLang --max-running-requests.", minimum=1)
    chunked_prefill_size: int | None = fld(
        None, "SGLang --chunked-prefill-size; -1 disables chunking.", minimum=-1
    )
    schedule_policy: SchedulePolicy = fld("fcfs", "SGLang --schedule-policy.")
    radix_cache: bool = fld(True, "Prefix caching; false adds --disable-radix-cache.")
    page_size: int | None = fld(
        None,
        "SGLang --page-size: tokens per KV page, the unit of prefix caching and of KV events."
        " Unset: SGLang's default (1), or 16 with gateway.prefixIndex: events (the gateway"
        " hashes every prompt page by page; 16 keeps that near 100 µs for 2,000 tokens).",
        minimum=1,
        maximum=256,
    )
    quantization: Quantization | None = fld(None, "SGLang --quantization.")
    kv_cache_dtype: Literal["auto", "fp8_e5m2", "fp8_e4m3"] = fld("auto", "--kv-cache-dtype.")
    speculative: Speculative | None = fld(None, "Speculative decoding.")
    env: tuple[EnvVar, ...] = fld(
        (),
        "Extra environment variables for the engine, each name once; not those the operator"
        " sets (" + ", ".join(OPERATOR_ENV) + ").",
        max_items=64,
        unique_by="name",
    )
    extra_args: tuple[str, ...] = fld(
        (),
        "Extra SGLang flags. Managed flags, and any abbreviation of one (SGLang's parser"
        " accepts unique prefixes), are rejected: "
        + ", ".join(MANAGED_FLAGS)
        + "; so are "
        + ", ".join(FORBIDDEN_FLAGS)
        + ". Passed as written: a `$` is written as `$$` for the kubelet, so `$(VAR)` is not"
        " expanded.",
        max_items=64,
        max_length=512,
        item_rule=EXTRA_ARG_RULE,
    )
    startup_timeout_seconds: int = fld(
        1800, "Longest model load before the pod is restarted (startup probe).", minimum=60
    )
    termination_grace_period_seconds: int = fld(
        120, "Time a stopping replica has to finish its running requests.", minimum=5
    )
    shm_size: str = fld("16Gi", "Size of the /dev/shm memory volume (NCCL, tensor parallel).")


GpuType = Literal["h100", "h200", "a100-80g", "l40s"]


@dataclass(frozen=True, kw_only=True)
class PrefillPool:
    """The prefill engines of a disaggregated service: a fixed number, or autoscaled on their
    own signals (their queues of prompts, the service's demand and TTFT)."""

    RULES: ClassVar = (
        Rule(
            "!(has(self.replicas) && has(self.autoscaling))",
            "replicas and autoscaling are mutually exclusive: with autoscaling the operator"
            " owns the prefill replica count",
            ".replicas",
        ),
        Rule(
            "!has(self.autoscaling) || !has(self.autoscaling.slo)"
            " || !has(self.autoscaling.slo.itlSeconds)",
            "the prefill pool makes the first token only: set itlSeconds on the decode pool's"
            " autoscaling.slo",
            ".autoscaling.slo.itlSeconds",
        ),
    )
    replicas: int | None = fld(
        None, "Prefill engine replicas when autoscaling is absent (default 1).", minimum=1,
        maximum=1000,
    )  # fmt: skip
    autoscaling: Autoscaling | None = fld(
        None,
        "Bounds for the operator's autoscaler of the prefill pool (minReplicas at least 1:"
        " a disaggregated service cannot serve without a prefill engine).",
    )
    tensor_parallel: Literal[1, 2, 4, 8] | None = fld(
        None, "GPUs per prefill engine; unset: engine.tensorParallel."
    )
    gpu_type: GpuType | None = fld(None, "GPU model of the prefill engines; unset: engine.gpuType.")
    extra_args: tuple[str, ...] | None = fld(
        None,
        "Extra SGLang flags of the prefill engines instead of engine.extraArgs (unset: the"
        " same); the flags engine.extraArgs refuses are refused here too.",
        max_items=64,
        max_length=512,
        item_rule=EXTRA_ARG_RULE,
    )
    resources: ResourceOverrides | None = fld(
        None,
        "CPU and memory overrides of the prefill engines instead of engine.resources (unset:"
        " the same): a prefill engine holds a batch of long prompts, not many streams.",
    )


@dataclass(frozen=True, kw_only=True)
class Disaggregation:
    """Prefill/decode disaggregation (SGLang's PD mode): prompts are computed on a prefill
    pool and their KV handed to the decode pool, which streams the answer. `engine`,
    `replicas` and `autoscaling` then describe the decode pool."""

    RULES: ClassVar = (
        Rule(
            "!has(self.prefill.autoscaling) || self.prefill.autoscaling.minReplicas >= 1",
            "a disaggregated service needs a prefill engine: prefill.autoscaling.minReplicas"
            " must be at least 1",
            ".prefill.autoscaling.minReplicas",
        ),
    )
    prefill: PrefillPool = fld(PrefillPool, "The prefill pool.")
    transfer_backend: Literal["mooncake", "nixl", "fake"] = fld(
        "mooncake",
        "SGLang --disaggregation-transfer-backend: how KV moves (mooncake or nixl over RDMA or"
        " TCP; fake: no transfer, for testing the wiring).",
    )
    bootstrap_port: int = fld(
        8998,
        "SGLang --disaggregation-bootstrap-port of the prefill engines (decode engines ask it"
        " for each request's KV).",
        minimum=1024,
        maximum=65535,
    )
    ib_device: str | None = fld(
        None,
        "SGLang --disaggregation-ib-device (e.g. mlx5_0): KV over InfiniBand/RoCE. Engine"
        " containers then get the IPC_LOCK capability (pinned RDMA memory).",
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_,.-]*$",
        max_length=256,
    )
    rdma_resource: str | None = fld(
        None,
        "The extended resource your RDMA device plugin offers (e.g. rdma/rdma_shared_device_a):"
        " one is requested per engine pod when ibDevice is set.",
        pattern=r"^[a-z0-9.-]+/[A-Za-z0-9_.-]+$",
        max_length=253,
    )


@dataclass(frozen=True, kw_only=True)
class CostSpec:
    gpu_hourly_price: float = fld(
        0.0, "Price of one GPU-hour; 0 reports GPU-seconds only.", minimum=0
    )


@dataclass(frozen=True, kw_only=True)
class SchedulingSpec:
    node_selector: dict[str, str] = fld(dict, "Extra node labels engine pods require.")
    tolerations: tuple[Json, ...] = fld(
        (), "Tolerations (e.g. for tainted GPU nodes).", max_items=64
    )
    affinity: Json | None = fld(None, "Pod affinity rules, as in a pod spec.")
    priority_class_name: str | None = fld(None, "PriorityClass of the engine pods.")


@dataclass(frozen=True, kw_only=True)
class ModelCache:
    """A PVC shared by all replicas for downloaded weights (a restart does not download again)."""

    RULES: ClassVar = (
        Rule(
            "has(self.claimName) != has(self.size)",
            "give exactly one of claimName (an existing PVC) or size (a PVC the operator creates)",
        ),
    )
    claim_name: str | None = fld(None, "An existing ReadWriteMany PVC.")
    size: str | None = fld(None, "Size of a PVC the operator creates, e.g. 200Gi.")
    storage_class_name: str | None = fld(None, "StorageClass of the created PVC (RWX).")


@dataclass(frozen=True, kw_only=True)
class InferenceServiceSpec:
    """An SGLang model server fleet with its routing gateway."""

    RULES: ClassVar = (
        GATEWAY_KEYS_RULE,
        Rule(
            "!has(self.lora) || !has(self.disaggregation)",
            "lora with disaggregation is not supported yet: the gateway routes adapters to"
            " colocated engines only",
            ".lora",
        ),
        Rule(
            "self.gateway.prefixIndex != 'events' || !has(self.model.source.uri)",
            "gateway.prefixIndex: events needs the model's tokenizer: give model.source as"
            " huggingFace or pvc",
            ".gateway.prefixIndex",
        ),
        Rule(
            "self.gateway.prefixIndex != 'events' || self.engine.radixCache",
            "gateway.prefixIndex: events needs the engines' prefix cache (engine.radixCache)",
            ".gateway.prefixIndex",
        ),
        Rule(
            "!has(self.disaggregation) || self.gateway.enabled",
            "disaggregation needs the gateway: it pairs each request's prefill and decode engines",
            ".disaggregation",
        ),
        Rule(
            "!has(self.disaggregation) || self.engine.radixCache",
            "disaggregation keeps the prefix cache on the prefill engines: leave"
            " engine.radixCache on",
            ".disaggregation",
        ),
        Rule(
            "!has(self.gateway.inferenceGateway) || !has(self.autoscaling)"
            " || self.autoscaling.minReplicas > 0",
            "scaling from zero needs the service's own gateway: the autoscaler does not read a"
            " shared gateway's held requests yet (set autoscaling.minReplicas ≥ 1)",
            ".autoscaling.minReplicas",
        ),
        Rule(
            "!has(self.gateway.inferenceGateway) || !has(self.autoscaling)"
            " || !has(self.autoscaling.slo)",
            "autoscaling.slo is judged on the service's own gateway's latency histograms: not"
            " yet behind a shared InferenceGateway",
            ".autoscaling.slo",
        ),
        Rule(
            "!(has(self.replicas) && has(self.autoscaling))",
            "replicas and autoscaling are mutually exclusive: with autoscaling the operator"
            " owns the replica count",
            ".replicas",
        ),
        Rule(
            "!has(self.lora) || self.lora.adapters.all(a, a.name != self.model.name"
            " && !(a.name in self.model.aliases))",
            "an adapter's name is the model's served name or alias: clients could not tell"
            " them apart",
            ".lora.adapters",
        ),
    )
    model: ModelSpec = fld(doc="The model to serve.")
    engine: EngineSpec = fld(EngineSpec, "The SGLang engine of each replica.")
    replicas: int | None = fld(
        None, "Engine replicas when autoscaling is absent (default 1).", minimum=0, maximum=1000
    )
    autoscaling: Autoscaling | None = fld(None, "Bounds for the operator's autoscaler.")
    disaggregation: Disaggregation | None = fld(
        None,
        "Prefill/decode disaggregation: a prefill pool beside the engines, which become the"
        " decode pool (engine, replicas and autoscaling describe it).",
    )
    lora: LoraSpec | None = fld(None, "LoRA adapters served beside the model.")
    gateway: GatewaySpec = fld(GatewaySpec, "The routing gateway.")
    cost: CostSpec = fld(CostSpec, "Cost accounting.")
    scheduling: SchedulingSpec = fld(SchedulingSpec, "Where engine pods may run.")
    model_cache: ModelCache | None = fld(None, "Shared cache of downloaded weights.")

    @property
    def manual_replicas(self) -> int:
        return 1 if self.replicas is None else self.replicas


def parse_spec(spec: Any) -> InferenceServiceSpec:
    """The custom resource's `.spec`, defaulted and validated (raises ConfigError)."""
    return parse(InferenceServiceSpec, spec, "spec")
