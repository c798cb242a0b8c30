"""How long a step takes, from GPU operator timings measured by vidur (microsoft/vidur, MIT).

vidur ran each operator of a transformer layer on real GPUs and published the medians
(`data/vidur/`, with its license and a SOURCE note saying which files and rows were taken).
A step's time is built as vidur builds it: per layer, the token-wise operators (QKV and output
projections, rotary, norms, MLP up/act/down, residual add) at the batch's token count, the
attention kernels (prefill by causal pairs, decode by requests and KV length, the KV-cache
write), and two tensor-parallel all-reduces of the batch's activations with NCCL's launch
cost; times the layer count. As in vidur's default configuration, the CPU side (scheduling,
sampling) and the LM head are not modelled, and a GQA attention kernel over more than one
sequence costs 10% more than over one.

How the measured points are turned into a prediction (vidur itself fits random forests or
linear regressions over them; nothing of its code is used here):

* token-wise operators and the all-reduce: piecewise-linear interpolation over the measured
  grid (451 token counts from 1 to 32,768; 993 message sizes from 2 KiB to 64 MiB). The grids
  are dense, so interpolation reproduces every measured point and assumes no functional form;
  past the grid's end it extrapolates along the last segment.
* attention: a least-squares line over physically chosen features, because only a sample of
  the attention table could be carried (see SOURCE.md) and a sample is no grid. Decode is
  `a + b·requests + c·(KV tokens read × KV heads per GPU)`; prefill is
  `a + b·(causal query-key pairs × query heads per GPU)`. The KV write is
  `a + b·requests` for decode rows; for prefill rows it is interpolated over the chunk sizes
  sampled (64–960 tokens) and held at its last measured value beyond them (it is mostly a
  fixed per-call cost there, and a line through 64–960 would put 5 ms per layer on a 8k-token
  chunk; vidur's random forests cannot extrapolate either). The fit uses the one-GPU rows; other
  tensor-parallel degrees follow through the heads per GPU (a test holds the four-GPU rows
  out and checks the prediction against them).

A (model, GPU, TP) triple is *profiled* when its layer shape, GPU and TP degree are in the
tables and it runs in 16-bit (vidur measured no FP8). Everything else keeps the roofline.
"""

from __future__ import annotations

import bisect
import csv
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Literal

from kvfleet_sim.config import ConfigError, EngineLayout
from kvfleet_sim.costmodel import PROFILES, CostModel, RooflineCostModel, StepCost, StepShape

Truth = Literal["auto", "measured", "roofline"]
TRUTHS: tuple[str, ...] = ("auto", "measured", "roofline")
DEFAULT_TRUTH: Truth = "auto"
"""Measured timings wherever the (model, GPU, TP) triple is profiled, the roofline elsewhere."""

MS = 1e-3
NCCL_LAUNCH_S = 0.02 * MS
"""vidur's `nccl_cpu_launch_overhead_ms`, added to each all-reduce."""
GQA_BATCHING_OVERHEAD = 0.10
"""vidur's attention batching overhead fraction (GQA models, more than one sequence)."""
ACTIVATION_BYTES = 2  # fp16 activations: vidur's all-reduce size is tokens × hidden × 2
TOKEN_OPS = (
    "attn_pre_proj",
    "attn_post_proj",
    "attn_rope",
    "input_layernorm",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)


@dataclass(frozen=True)
class LayerShape:
    """What vidur's tables are keyed by: one dense decoder layer."""

    hidden: int
    heads: int
    kv_heads: int
    intermediate: int


@dataclass(frozen=True)
class Profiled:
    gpu: str
    layer: LayerShape
    compute_dir: str
    network: str


PROFILED: tuple[Profiled, ...] = (
    # Llama-3-8B's layer, which Llama-3.1-8B (and Mistral-7B) share: vidur keys its tables by
    # the layer's shape, not the model's name.
    Profiled(
        "a100-80g",
        LayerShape(4096, 32, 8, 14336),
        "compute/a100/meta-llama/Meta-Llama-3-8B",
        "network/a100_dgx",
    ),
)
TP_DEGREES = (1, 2, 4, 8)


class Curve:
    """Piecewise-linear interpolation over (x, y) points; linear extrapolation at the ends."""

    def __init__(self, points: Sequence[tuple[float, float]], *, clamp: bool = False) -> None:
        self.clamp = clamp
        """Hold the end values outside the measured range instead of extrapolating."""
        merged: dict[float, list[float]] = {}
        for x, y in points:
            merged.setdefault(x, []).append(y)
        self.xs = sorted(merged)
        self.ys = [sum(merged[x]) / len(merged[x]) for x in self.xs]
        if len(self.xs) < 2:
            raise ValueError("a curve needs at least two distinct points")

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if self.clamp:
            x = min(max(x, xs[0]), xs[-1])
        i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Coefficients minimising Σ(row·β − y)²: the normal equations, by Gaussian elimination."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda k: abs(a[k][col]))
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for k in range(col + 1, n):
            f = a[k][col] / a[col][col]
            a[k] = [u - f * v for u, v in zip(a[k], a[col], strict=True)]
            b[k] -= f * b[col]
    beta = [0.0] * n
    for i in reversed(range(n)):
        beta[i] = (b[i] - sum(a[i][j] * beta[j] for j in range(i + 1, n))) / a[i][i]
    return beta


def _read(path: str) -> list[dict[str, str]]:
    text = (resources.files("kvfleet_sim") / "data" / "vidur" / path).read_text()
    return list(csv.DictReader(text.splitlines()))


@dataclass(frozen=True)
class AttentionFit:
    """Per-layer attention in ms; features as in the module docstring (one-GPU fit)."""

    decode: tuple[float, float, float]
    prefill: tuple[float, float]
    save_prefill: Curve
    save_decode: tuple[float, float]


@functools.cache
def attention_fit(compute_dir: str, kv_heads: int, heads: int) -> AttentionFit:
    rows = [r for r in _read(f"{compute_dir}/attention-sample.csv")]
    one = [r for r in rows if r["num_tensor_parallel_workers"] == "1"]
    pre = [r for r in one if r["is_prefill"] == "True"]
    dec = [r for r in one if r["is_prefill"] == "False"]
    med = "time_stats.attn_{}.median".format
    decode = least_squares(
        [[1.0, float(r["batch_size"]), decode_feature(r, kv_heads)] for r in dec],
        [float(r[med("decode")]) for r in dec],
    )
    prefill = least_squares(
        [[1.0, prefill_feature(r, heads)] for r in pre], [float(r[med("prefill")]) for r in pre]
    )
    save_p = Curve(
        [(float(r["prefill_chunk_size"]), float(r[med("kv_cache_save")])) for r in pre],
        clamp=True,
    )
    save_d = least_squares(
        [[1.0, float(r["batch_size"])] for r in dec], [float(r[med("kv_cache_save")]) for r in dec]
    )
    return AttentionFit(
        (decode[0], decode[1], decode[2]),
        (prefill[0], prefill[1]),
        save_p,
        (save_d[0], save_d[1]),
    )


def decode_feature(row: dict[str, str], kv_heads_per_gpu: float) -> float:
    return float(row["batch_size"]) * float(row["kv_cache_size"]) * kv_heads_per_gpu


def prefill_feature(row: dict[str, str], heads_per_gpu: float) -> float:
    n, c = float(row["prefill_chunk_size"]), float(row["kv_cache_size"])
    return StepShape.prefill_pairs(int(n), int(c)) * heads_per_gpu


@functools.cache
def token_curve(compute_dir: str, tp: int) -> Curve:
    """Σ of the token-wise operators of one layer (ms) against the batch's token count."""
    rows = [
        r for r in _read(f"{compute_dir}/mlp.csv") if int(r["num_tensor_parallel_workers"]) == tp
    ]
    points = [
        (float(r["num_tokens"]), sum(float(r[f"time_stats.{op}.median"]) for op in TOKEN_OPS))
        for r in rows
    ]
    return Curve(points)


@functools.cache
def allreduce_curve(network: str, tp: int) -> Curve:
    """One all-reduce (ms) against its size in bytes, the group inside one node."""
    rows = _read(f"{network}/all_reduce.csv")
    points = [
        (float(r["size"]), float(r["time_stats.all_reduce.median"]))
        for r in rows
        if int(r["num_workers"]) == tp and int(r["devices_per_node"]) == tp
    ]
    return Curve(points)


def profiled_entry(layout: EngineLayout) -> Profiled | None:
    """The measured tables that time this engine, or None (then the roofline does)."""
    cfg = layout.config
    m = cfg.model
    if cfg.quantization != "none" or cfg.kv_cache_dtype != "auto" or m.is_moe or m.is_mla:
        return None
    if cfg.tp_size not in TP_DEGREES or m.num_kv_heads % cfg.tp_size:
        return None
    shape = LayerShape(m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size)
    if m.head_dim * m.num_heads != m.hidden_size:
        return None
    return next((p for p in PROFILED if p.gpu == cfg.gpu.name and p.layer == shape), None)


class MeasuredCostModel:
    """A `CostModel` read from vidur's measured operator timings (see the module docstring)."""

    def __init__(self, layout: EngineLayout, entry: Profiled) -> None:
        cfg = layout.config
        self.layout = layout
        self.entry = entry
        self.tp = cfg.tp_size
        self.layers = cfg.model.num_layers
        self.hidden = cfg.model.hidden_size
        self.kv_heads_per_gpu = cfg.model.num_kv_heads / self.tp
        self.heads_per_gpu = cfg.model.num_heads / self.tp
        self.gqa = cfg.model.num_heads > cfg.model.num_kv_heads
        self.fit = attention_fit(entry.compute_dir, cfg.model.num_kv_heads, cfg.model.num_heads)
        self.tokens = token_curve(entry.compute_dir, self.tp)
        self.allreduce = allreduce_curve(entry.network, self.tp) if self.tp > 1 else None

    def _attention_ms(self, shape: StepShape) -> float:
        f, ms = self.fit, 0.0
        batching = 1.0 + (GQA_BATCHING_OVERHEAD if self.gqa else 0.0)
        if shape.prefill_seqs:
            a, b = f.prefill
            t = a + b * shape.prefill_attn_pairs * self.heads_per_gpu
            ms += max(t, 0.0) * (batching if shape.prefill_seqs > 1 else 1.0)
            ms += f.save_prefill(shape.prefill_tokens)
        if shape.decode_seqs:
            a, b, c = f.decode
            read = shape.decode_ctx_tokens * self.kv_heads_per_gpu
            t = a + b * shape.decode_seqs + c * read
            ms += max(t, 0.0) * (batching if shape.decode_seqs > 1 else 1.0)
            ms += max(f.save_decode[0] + f.save_decode[1] * shape.decode_seqs, 0.0)
        return ms

    def step_cost(self, shape: StepShape) -> StepCost:
        tokens = shape.prefill_tokens + shape.decode_seqs
        if tokens == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, "-", "-")
        linear = self.tokens(tokens) * MS * self.layers
        attention = self._attention_ms(shape) * MS * self.layers
        allreduce = overhead = 0.0
        if self.allreduce is not None:
            size = tokens * self.hidden * ACTIVATION_BYTES
            allreduce = 2 * self.layers * self.allreduce(size) * MS
            overhead = 2 * self.layers * NCCL_LAUNCH_S
        return StepCost(linear, attention, allreduce, overhead, "measured", "measured")

    def step_time(self, shape: StepShape) -> float:
        return self.step_cost(shape).total_s


def build_cost_model(layout: EngineLayout, profile: str, truth: str = DEFAULT_TRUTH) -> CostModel:
    """The simulator's truth for one engine: measured timings where profiled (`auto`,
    `measured`), else the roofline with the engine profile's fitted constants."""
    if truth not in TRUTHS:
        raise ConfigError(f"cost model must be one of {TRUTHS}, got {truth!r}")
    entry = profiled_entry(layout) if truth != "roofline" else None
    if entry is not None:
        return MeasuredCostModel(layout, entry)
    if truth == "measured":
        cfg = layout.config
        raise ConfigError(
            f"no measured GPU timings for {cfg.model.name} on {cfg.gpu.name} at TP{cfg.tp_size}"
            f" ({cfg.quantization}, KV {cfg.kv_cache_dtype})"
        )
    return RooflineCostModel(layout, PROFILES[profile])
