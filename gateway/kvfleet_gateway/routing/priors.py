"""Where the kvfleet policy's model of a replica starts: what a deployment knows before its
first request — the model's config.json and the GPU's datasheet — and nothing measured.

A roofline with one round efficiency factor, deliberately not fitted to anything:
    prefill      2 FLOPs per active parameter per prompt token, at `efficiency` × peak FLOPs
    decode step  every weight streamed once from HBM, at `efficiency` × peak bandwidth
    KV read      each token of KV in use read once per decode step, at the same bandwidth
(attention FLOPs, launch overheads and communication are left out; tensor parallelism
divides the work evenly). Online calibration (`KvfleetPolicy.observe`) moves the prefill rate
and the decode step to what the replicas actually show within a few dozen requests; these
numbers only have to be the right order of magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvfleet_gateway.model_config import ModelArchitecture, parse_model_config, read_model_config


@dataclass(frozen=True)
class GpuPeak:
    """An accelerator's datasheet peaks (dense, no sparsity)."""

    bf16_flops: float
    fp8_flops: float
    """Equals bf16_flops on GPUs without FP8 tensor cores."""
    hbm_bytes_per_s: float


GpuName = Literal["h100", "h200", "a100-80g", "l40s"]
GPU_PEAKS: dict[str, GpuPeak] = {
    # NVIDIA H100 SXM5 80 GB datasheet: 989 TFLOP/s BF16, 1,979 FP8 (dense), 3.35 TB/s HBM3
    "h100": GpuPeak(989e12, 1979e12, 3.35e12),
    # NVIDIA H200 SXM 141 GB datasheet: H100's compute, 4.8 TB/s HBM3e
    "h200": GpuPeak(989e12, 1979e12, 4.8e12),
    # NVIDIA A100 SXM4 80 GB datasheet: 312 TFLOP/s BF16, no FP8 tensor cores, 2.039 TB/s
    "a100-80g": GpuPeak(312e12, 312e12, 2.039e12),
    # NVIDIA L40S datasheet: 362 TFLOP/s BF16, 733 FP8 (dense), 864 GB/s GDDR6
    "l40s": GpuPeak(362e12, 733e12, 0.864e12),
}

DEFAULT_EFFICIENCY = 0.5
"""Share of the datasheet peaks a serving engine is assumed to reach: a round number, not a
measurement (real engines reach roughly 30–70% of peak FLOPs in prefill and of peak bandwidth
in decode, depending on batch and kernels)."""

LLAMA_3_1_8B = parse_model_config(
    {  # meta-llama/Llama-3.1-8B-Instruct's config.json (the fields the parser reads)
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
    "Llama-3.1-8B",
)
"""The model assumed when the gateway is given no config.json."""


@dataclass(frozen=True)
class Priors:
    prefill_tokens_per_second: float
    decode_step_base_s: float
    kv_read_s_per_token: float
    basis: str
    """What they were derived from, for logs and reports."""


def roofline_priors(
    model: ModelArchitecture,
    gpu: GpuPeak,
    tensor_parallel: int = 1,
    efficiency: float = DEFAULT_EFFICIENCY,
    basis: str = "",
) -> Priors:
    fp8 = model.checkpoint_quantization == "fp8"
    flops = (gpu.fp8_flops if fp8 else gpu.bf16_flops) * efficiency * tensor_parallel
    bandwidth = gpu.hbm_bytes_per_s * efficiency * tensor_parallel
    return Priors(
        prefill_tokens_per_second=flops / (2.0 * model.active_params_per_token),
        decode_step_base_s=model.num_params * model.weight_bytes_per_param / bandwidth,
        kv_read_s_per_token=model.kv_bytes_per_token / bandwidth,
        basis=basis,
    )


def priors_for(
    model_config: str | None, gpu: str, tensor_parallel: int, efficiency: float
) -> Priors:
    """The priors a gateway configured so starts from (reads `model_config` when given:
    call it once, at startup)."""
    model = read_model_config(Path(model_config)) if model_config else LLAMA_3_1_8B
    name = model_config or "Llama-3.1-8B (no model config given)"
    basis = f"{name} on {gpu} × {tensor_parallel} at {efficiency:.0%} of peak"
    return roofline_priors(model, GPU_PEAKS[gpu], tensor_parallel, efficiency, basis)
