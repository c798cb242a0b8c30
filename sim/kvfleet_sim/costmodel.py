"""How long one scheduler step takes on the GPU, from first principles.

A step runs every layer once over a batch. Each kernel family is a roofline of its own and
they run one after another, so their times add:

* linear layers (QKV/O projections, MLP, LM head): FLOPs = 2 × params × tokens, bytes = all
  weights once per step. Decode at small batch is bound by reading the weights; prefill and
  very large decode batches are bound by tensor-core throughput. A mixture of experts
  multiplies each token by its *active* parameters only, and a step reads the routed experts
  its tokens touch (expected distinct experts under uniform routing), not all of them.
* attention: prefill does 4 × layers × heads × head_dim FLOPs per (query, key) pair under a
  causal mask, including keys already in the prefix cache; decode reads every running
  request's whole KV cache (bandwidth-bound at any batch size).
* tensor-parallel all-reduce: two per layer over the batch's activations (ring algorithm).
* fixed per-step and per-sequence overheads (scheduling, sampling, kernel launches).

Peak numbers come from the catalogue; *achievable* fractions of them are the only fitted
constants, one `EngineProfile` per engine generation (see `PROFILES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvfleet_sim.config import EngineLayout


@dataclass(frozen=True, slots=True)
class StepShape:
    """Aggregate shape of one batch (sums, so building it is O(batch) with no allocation)."""

    prefill_tokens: int = 0
    """New tokens computed this step by prefill (extend) sequences."""
    prefill_seqs: int = 0
    prefill_attn_pairs: float = 0.0
    """Σ over prefill sequences of causal (query, key) pairs: n·c + n·(n+1)/2."""
    prefill_ctx_tokens: int = 0
    """Σ cached-prefix tokens the prefill sequences attend to (their KV is read)."""
    decode_seqs: int = 0
    decode_ctx_tokens: int = 0
    """Σ sequence lengths of the decoding requests (KV read this step)."""

    @staticmethod
    def prefill_pairs(new_tokens: int, cached_tokens: int) -> float:
        return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2


@dataclass(frozen=True)
class StepCost:
    """A step's time and the terms it is made of (seconds)."""

    linear_s: float
    attention_s: float
    allreduce_s: float
    overhead_s: float
    linear_bound: str
    attention_bound: str

    @property
    def total_s(self) -> float:
        return self.linear_s + self.attention_s + self.allreduce_s + self.overhead_s

    def dominant(self) -> str:
        terms = {
            f"linear ({self.linear_bound})": self.linear_s,
            f"attention ({self.attention_bound})": self.attention_s,
            "all-reduce": self.allreduce_s,
            "overhead": self.overhead_s,
        }
        return max(terms, key=lambda k: terms[k])


class CostModel(Protocol):
    """What the scheduler needs: the duration of a step of a given shape."""

    def step_time(self, shape: StepShape) -> float: ...

    def step_cost(self, shape: StepShape) -> StepCost: ...


@dataclass(frozen=True)
class EngineProfile:
    """Achievable fractions of peak for one engine generation. One set per generation."""

    name: str
    matmul_efficiency: float
    """Achieved / peak tensor-core FLOP/s for GEMMs and attention (model FLOPs utilisation)."""
    bandwidth_efficiency: float
    """Achieved / peak HBM bandwidth when streaming weights and KV."""
    step_overhead_s: float
    """Fixed cost per scheduler step: scheduling, sampling, launches not hidden by CUDA graphs."""
    seq_overhead_s: float
    """Per sequence per step: batch bookkeeping, detokenisation, output processing."""


PROFILES: dict[str, EngineProfile] = {
    # SGLang (continuous batching, radix cache, FlashInfer, CUDA graphs for decode). Fitted once
    # to the only published end-to-end SGLang number we calibrate on, sglang#1639 (v0.3,
    # Llama-3-8B, TP2 on two H100s, 2,000 ShareGPT prompts at once: 10,897 output tok/s):
    # * GEMMs + attention at 45% of dense BF16 peak: 8k-token prefill chunks split over two
    #   ranks give GEMMs of N = 2,048..7,168, which reach ~60% on H100, diluted by norms,
    #   rotary and sampling kernels that the FLOP count ignores;
    # * weight and KV streaming at 70% of HBM peak (FlashInfer decode reaches 70-80%);
    # * 3 ms per step and 10 µs per sequence on the CPU: v0.3 scheduled, sampled and
    #   detokenised between GPU steps (the overlap scheduler of v0.4 later hid part of it),
    #   and its per-request Python bookkeeping grows with the batch.
    # Newer releases are somewhat faster; this profile is deliberately the measured one.
    "sglang": EngineProfile(
        name="sglang",
        matmul_efficiency=0.45,
        bandwidth_efficiency=0.70,
        step_overhead_s=3.0e-3,
        seq_overhead_s=10.0e-6,
    ),
    # TensorRT-LLM 0.9 performance table (static batches, FP8 weights and FP8 KV). Its 2048/2048
    # row at batch 56 is pure decode: 2,048 steps each streaming ~7 GB of weights and ~11 GB of
    # KV in 14 ms, i.e. ~39% of H100's 3.35 TB/s — the "about a third" the old engine reached.
    # The 128/128 row at batch 896 is then GEMM-bound and fits ~35% of FP8 peak.
    "trtllm-0.9": EngineProfile(
        name="trtllm-0.9",
        matmul_efficiency=0.35,
        bandwidth_efficiency=0.39,
        step_overhead_s=0.5e-3,
        seq_overhead_s=0.0,
    ),
}
DEFAULT_PROFILE = "sglang"

ACTIVATION_BYTES = 2.0  # bf16 hidden states are what the all-reduce moves
GPUS_PER_NODE = 8
"""A tensor-parallel group wider than this spans nodes (multi-node replicas)."""
INTER_NODE_BANDWIDTH = 5.0e10
"""Bytes/s per GPU between nodes: one 400 Gb/s InfiniBand NIC per GPU (DGX/HGX H100)."""
INTER_NODE_LATENCY_S = 2.0e-5
"""Fixed cost of one small all-reduce across nodes (network round trips, vs ~8 µs on NVLink)."""


class RooflineCostModel:
    """The default `CostModel`; pure arithmetic over the layout and a profile."""

    def __init__(self, layout: EngineLayout, profile: EngineProfile) -> None:
        cfg = layout.config
        model, gpu, tp = cfg.model, cfg.gpu, cfg.tp_size
        self.layout = layout
        self.profile = profile
        matmul_peak = gpu.fp8_flops if cfg.quantization == "fp8" else gpu.bf16_flops
        self._linear_flops_rate = matmul_peak * profile.matmul_efficiency
        self._attn_flops_rate = gpu.bf16_flops * profile.matmul_efficiency
        self._bw = gpu.hbm_bandwidth * profile.bandwidth_efficiency
        # Per-token constants, per GPU.
        self._flops_per_token = 2.0 * model.active_body_params / tp
        self._flops_per_logit_row = 2.0 * model.lm_head_params / tp
        if model.is_mla:  # absorbed MLA: scores and values over the latent (+ rotary key)
            width = 2 * model.kv_lora_rank + model.qk_rope_head_dim
            self._attn_flops_per_pair = 2.0 * model.num_layers * model.num_heads * width / tp
        else:
            self._attn_flops_per_pair = (
                4.0 * model.num_layers * model.num_heads * model.head_dim / tp
            )
        self._model = model
        linear_bytes = 1.0 if cfg.quantization == "fp8" else 2.0
        expert_bytes = model.routed_expert_params * linear_bytes / tp
        self._expert_read_s = expert_bytes / self._bw
        """Reading every routed expert once (MoE; 0 for a dense model)."""
        self._weight_read_s = (layout.weight_bytes_per_gpu - expert_bytes) / self._bw
        self._kv_read_s_per_token = layout.kv_bytes_per_token_per_gpu / self._bw
        if tp > 1:
            ring = 2.0 * (tp - 1) / tp
            n_ar = 2 * model.num_layers
            # A group wider than a node all-reduces over the nodes' network: its slowest link.
            across = tp > GPUS_PER_NODE
            link = min(gpu.interconnect_bandwidth, INTER_NODE_BANDWIDTH) if across else None
            self._ar_fixed_s = n_ar * (
                max(gpu.allreduce_latency_s, INTER_NODE_LATENCY_S)
                if across
                else gpu.allreduce_latency_s
            )
            self._ar_s_per_token = (
                n_ar
                * ring
                * model.hidden_size
                * ACTIVATION_BYTES
                / (link or gpu.interconnect_bandwidth)
            )
        else:
            self._ar_fixed_s = 0.0
            self._ar_s_per_token = 0.0

    def step_cost(self, shape: StepShape) -> StepCost:
        tokens = shape.prefill_tokens + shape.decode_seqs
        seqs = shape.prefill_seqs + shape.decode_seqs
        if tokens == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, "-", "-")
        linear_compute = (
            tokens * self._flops_per_token + seqs * self._flops_per_logit_row
        ) / self._linear_flops_rate
        linear_memory = self._weight_read_s
        if self._expert_read_s:
            touched = self._model.experts_touched(tokens) / self._model.num_experts
            linear_memory += self._expert_read_s * touched
        attn_compute = (
            (shape.prefill_attn_pairs + shape.decode_ctx_tokens) * self._attn_flops_per_pair
        ) / self._attn_flops_rate
        attn_memory = (shape.decode_ctx_tokens + shape.prefill_ctx_tokens) * (
            self._kv_read_s_per_token
        )
        return StepCost(
            linear_s=max(linear_compute, linear_memory),
            attention_s=max(attn_compute, attn_memory),
            allreduce_s=self._ar_fixed_s + tokens * self._ar_s_per_token,
            overhead_s=self.profile.step_overhead_s + seqs * self.profile.seq_overhead_s,
            linear_bound="compute" if linear_compute >= linear_memory else "memory",
            attention_bound="compute" if attn_compute >= attn_memory else "memory",
        )

    def step_time(self, shape: StepShape) -> float:
        return self.step_cost(shape).total_s
