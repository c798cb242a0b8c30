"""Engine configuration: SGLang's server arguments, and what SGLang derives from them.

`EngineConfig` mirrors the `python -m sglang.launch_server` flags the simulator understands
(same names, same defaults). `EngineLayout` is what SGLang computes at start-up from them:
weight bytes per GPU, KV bytes per token, the KV pool size (`max_total_num_tokens`) and the
request-slot limit, using the same formulas, so `/server_info` reports what a real server would.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Literal

from kvfleet_sim.catalog import GIB, GpuSpec, ModelSpec

Quantization = Literal["none", "fp8"]
KvCacheDtype = Literal["auto", "fp8_e4m3", "fp8_e5m2"]
SchedulePolicy = Literal["fcfs", "lpm"]

QUANTIZATIONS: tuple[str, ...] = ("none", "fp8")
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3", "fp8_e5m2")
SCHEDULE_POLICIES: tuple[str, ...] = ("fcfs", "lpm")
TP_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
"""Above 8 (a node's GPUs) the tensor-parallel group spans nodes (SGLang's --nnodes)."""


class ConfigError(ValueError):
    """A configuration SGLang itself would refuse to start with."""


@dataclass(frozen=True)
class EngineConfig:
    """Server arguments. `None` means "derive it as SGLang does"."""

    model: ModelSpec
    gpu: GpuSpec
    tp_size: int = 1
    """`--tp-size`: GPUs per replica; splits weights and KV heads."""
    quantization: Quantization = "none"
    """`--quantization`: `fp8` stores linear weights in one byte and runs them at the FP8 rate."""
    kv_cache_dtype: KvCacheDtype = "auto"
    """`--kv-cache-dtype`: `auto` is the model dtype (bf16); fp8 variants halve KV bytes."""
    mem_fraction_static: float | None = None
    """`--mem-fraction-static`: share of GPU memory for weights + KV pool (SGLang's table)."""
    context_length: int | None = None
    """`--context-length`: defaults to the model's."""
    max_running_requests: int | None = None
    """`--max-running-requests`: defaults to SGLang's request-pool derivation."""
    max_total_tokens: int | None = None
    """`--max-total-tokens`: caps the KV pool (tokens)."""
    max_queued_requests: int | None = None
    """`--max-queued-requests`: beyond it new requests get 503; None = unbounded."""
    chunked_prefill_size: int | None = None
    """`--chunked-prefill-size`: max prefill tokens per step per batch; -1 disables chunking."""
    max_prefill_tokens: int = 16384
    """`--max-prefill-tokens`: cap on new input tokens in one prefill batch."""
    schedule_policy: SchedulePolicy = "fcfs"
    """`--schedule-policy`."""
    disable_radix_cache: bool = False
    """`--disable-radix-cache`."""
    page_size: int = 1
    """`--page-size`: KV allocation granularity (1 on CUDA)."""
    schedule_conservativeness: float = 1.0
    """`--schedule-conservativeness`: scales the initial new_token_ratio."""
    max_loras_per_batch: int | None = None
    """`--enable-lora` with `--max-loras-per-batch`: distinct adapters one batch may run;
    None: LoRA off."""
    lora_rank: int = 16
    """`--max-lora-rank` (the rank adapters are sized at for their copy-in cost)."""

    @classmethod
    def for_model(
        cls, model: ModelSpec, gpu: GpuSpec, quantization: str | None = None, **kw: Any
    ) -> EngineConfig:
        """`quantization` None: the checkpoint's own, as SGLang reads it from the model's
        `quantization_config` when `--quantization` is not given."""
        q = model.checkpoint_quantization if quantization is None else quantization
        if q not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {q!r}")
        return cls(model=model, gpu=gpu, quantization=typing.cast(Quantization, q), **kw)

    def __post_init__(self) -> None:
        if self.tp_size not in TP_SIZES:
            raise ConfigError(f"tp_size must be one of {TP_SIZES}, got {self.tp_size}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {QUANTIZATIONS}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ConfigError(f"schedule_policy must be one of {SCHEDULE_POLICIES}")
        if self.mem_fraction_static is not None and not 0.05 < self.mem_fraction_static < 1:
            raise ConfigError("mem_fraction_static must be in (0.05, 1)")
        if self.page_size < 1:
            raise ConfigError("page_size must be >= 1")
        for name in ("context_length", "max_running_requests", "max_total_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1")


@dataclass(frozen=True)
class EngineLayout:
    """What a server derives at start-up; everything the cost model and scheduler need."""

    config: EngineConfig
    weight_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    mem_fraction_static: float
    max_total_num_tokens: int
    max_running_requests: int
    context_length: int
    chunked_prefill_size: int
    """Tokens per prefill step; `context_length` when chunking is disabled."""

    @property
    def model(self) -> ModelSpec:
        return self.config.model

    @property
    def gpu(self) -> GpuSpec:
        return self.config.gpu

    @property
    def max_req_input_len(self) -> int:
        return min(self.context_length - 1, self.max_total_num_tokens - 1)


def default_mem_fraction_static(gpu: GpuSpec, tp_size: int) -> float:
    """SGLang's table for large GPUs: more TP ranks reserve more for NCCL/CUDA-graph buffers."""
    if tp_size >= 8:
        return 0.81
    if tp_size >= 4:
        return 0.85
    if tp_size >= 2:
        return 0.87
    # Small cards keep more headroom for activations (SGLang lowers the fraction below 60 GB).
    return 0.88 if gpu.memory_bytes >= 60 * GIB else 0.85


def default_chunked_prefill_size(gpu: GpuSpec) -> int:
    """SGLang sizes prefill chunks by GPU memory: 8192 on 80-160 GB parts."""
    mem = gpu.memory_bytes / GIB
    if mem < 35:
        return 2048
    if mem < 60:
        return 4096
    if mem < 160:
        return 8192
    return 16384


def weight_bytes_per_gpu(model: ModelSpec, quantization: Quantization, tp_size: int) -> float:
    """FP8 quantizes the linear layers only; embedding and LM head stay bf16."""
    linear_bytes = 1.0 if quantization == "fp8" else 2.0
    heads = model.embedding_params + (0.0 if model.tied_embeddings else model.lm_head_params)
    return (model.body_params * linear_bytes + heads * 2.0) / tp_size


def kv_bytes_per_token_per_gpu(model: ModelSpec, kv_cache_dtype: KvCacheDtype, tp: int) -> float:
    """KV heads split across TP ranks, replicated once tp exceeds the KV head count. MLA
    stores one compressed latent (plus the rotary key) per token and layer, on every rank."""
    dtype_bytes = 2.0 if kv_cache_dtype == "auto" else 1.0
    if model.is_mla:
        return model.num_layers * (model.kv_lora_rank + model.qk_rope_head_dim) * dtype_bytes
    kv_heads_per_gpu = max(1, model.num_kv_heads // tp)
    return 2.0 * model.num_layers * kv_heads_per_gpu * model.head_dim * dtype_bytes


def derive_layout(config: EngineConfig) -> EngineLayout:
    """Size the KV pool and request slots the way SGLang's model runner does."""
    model, gpu, tp = config.model, config.gpu, config.tp_size
    weights = weight_bytes_per_gpu(model, config.quantization, tp)
    kv_per_token = kv_bytes_per_token_per_gpu(model, config.kv_cache_dtype, tp)
    fraction = config.mem_fraction_static or default_mem_fraction_static(gpu, tp)
    kv_budget = gpu.memory_bytes * fraction - weights
    if kv_budget <= 0:
        raise ConfigError(
            f"{model.name} needs {weights / GIB:.1f} GiB of weights per GPU at tp={tp}, more than "
            f"{fraction:.2f} of {gpu.name}'s {gpu.memory_bytes / GIB:.0f} GiB: raise --tp-size"
        )
    tokens = int(kv_budget // kv_per_token)
    if config.max_total_tokens is not None:
        tokens = min(tokens, config.max_total_tokens)
    tokens -= tokens % config.page_size
    context = config.context_length or model.context_length
    # SGLang's request-to-token pool: between 2048 and 4096 slots, then at most half the tokens.
    pool_slots = min(max(int(tokens / context * 512), 2048), 4096)
    max_running = min(pool_slots, max(1, tokens // 2))
    if config.max_running_requests is not None:
        max_running = min(max_running, config.max_running_requests)
    chunk = config.chunked_prefill_size
    if chunk is None:
        chunk = default_chunked_prefill_size(gpu)
    if chunk <= 0:
        chunk = context
    return EngineLayout(
        config=config,
        weight_bytes_per_gpu=weights,
        kv_bytes_per_token_per_gpu=kv_per_token,
        mem_fraction_static=fraction,
        max_total_num_tokens=tokens,
        max_running_requests=max_running,
        context_length=context,
        chunked_prefill_size=chunk,
    )
