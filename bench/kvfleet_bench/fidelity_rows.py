"""The published GPU results the simulator is compared with, each with its source.

Three kinds of row:
- **fit**: the simulator's engine profiles (`kvfleet_sim.costmodel.PROFILES`) were fitted to
  these numbers, so their error is in-sample and proves little;
- **held-out**: published results no constant was fitted to, from other engines, models,
  GPUs and sources; every one is simulated with the default `sglang` profile and the default
  truth (measured GPU timings where the triple is profiled, the roofline elsewhere), the ones
  every kvfleet benchmark runs, so its error is what a reader of those benchmarks should
  expect;
- **prediction**: shapes with no published figure, shown for inspection.

Model architectures not in the built-in catalogue are read from the `config.json` files under
`data/models/` (copies of the public Hugging Face configs' architecture fields), through the
same parser as `--model-config`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from kvfleet_sim.catalog import BUILTIN, ModelSpec
from kvfleet_sim.hf_config import load_model_config
from kvfleet_sim.offline import OfflineSpec

RowKind = Literal["fit", "held-out", "prediction"]

TRTLLM_09 = "TensorRT-LLM 0.9 performance table (static batches)"
TRTLLM_013 = (
    "NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md, the table generated with "
    "v0.13.0 (in-flight batching, trtllm-bench, 3,000 requests at 1000/1000)"
)
TRTLLM_1X = (
    "NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md at commit 00f37686 "
    "(PyTorch backend, trtllm-bench, 3,000 requests at 1000/1000)"
)
SGLANG_0453 = (
    "https://github.com/sgl-project/sglang/pull/5611#issuecomment-2819965621 (tracker "
    "sgl-project/sglang#5514: SGLang v0.4.5.post3, DeepSeek-V3 TP8 on 8× H200, bench_serving "
    "--random-range-ratio 1 --request-rate 10)"
)
VLLM_084 = (
    "vLLM v0.8.4 column of the same table (quoted in Michaelvll/llm-ie-benchmarks#3 from that "
    "repository's README: vLLM's own benchmark of DeepSeek-R1 on 8× H200; the arrival rate is "
    "not stated there, so the simulator uses SGLang's 10 req/s)"
)
CHECKPOINT_FP8 = {"quantization": "fp8"}
"""DeepSeek-V3/R1 ship FP8 weights, which SGLang and vLLM run as such; the KV cache stays
16-bit (SGLang's default KV dtype is the model's)."""
FP8 = {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}
"""TensorRT-LLM's FP8 builds quantize the KV cache too ("the KV cache will automatically be
set to FP8 as well", perf-overview.md)."""


@dataclass(frozen=True)
class FidelityRow:
    name: str
    kind: RowKind
    engine: str
    """The engine that produced the published number."""
    source: str
    """Where the number is published (URL or repository path)."""
    model: str
    """A catalogue name, or a directory under data/models/ holding a config.json."""
    gpu: str
    tp: int
    spec: OfflineSpec
    published: float | None
    extra: dict[str, Any] = field(default_factory=dict)
    """EngineConfig fields (quantization, KV dtype, batch cap)."""
    profile: str = "sglang"

    @property
    def moe(self) -> bool:
        return load_model(self.model).is_moe


@functools.cache
def load_model(name: str) -> ModelSpec:
    """A catalogue model, or one of the bench's own config.json files."""
    models = resources.files("kvfleet_bench") / "data" / "models"
    directory = Path(str(models / name))
    if (directory / "config.json").is_file():
        return load_model_config(directory, name)
    return BUILTIN.model(name)


THOUSANDS = OfflineSpec("random", 3000, 1000, 1000)
"""trtllm-bench's 1000/1000 case: 3,000 requests of fixed lengths, all at once."""

FIT = [
    FidelityRow(
        "Mistral-7B FP8, 128/128, batch 896",
        "fit",
        "TensorRT-LLM 0.9",
        TRTLLM_09,
        "mistral-7b",
        "h100",
        1,
        OfflineSpec("random", 896, 128, 128),
        20_404,
        {**FP8, "max_running_requests": 896},
        profile="trtllm-0.9",
    ),
    FidelityRow(
        "Mistral-7B FP8, 2048/2048, batch 56",
        "fit",
        "TensorRT-LLM 0.9",
        TRTLLM_09,
        "mistral-7b",
        "h100",
        1,
        OfflineSpec("random", 56, 2048, 2048),
        3_731,
        {**FP8, "max_running_requests": 56},
        profile="trtllm-0.9",
    ),
    FidelityRow(
        "Llama-3-8B TP2, 2,000 ShareGPT",
        "fit",
        "SGLang 0.3",
        "https://github.com/sgl-project/sglang/issues/1639",
        "llama-3.1-8b",
        "h100",
        2,
        OfflineSpec("sharegpt", 2000),
        10_897,
    ),
]

HELD_OUT = [
    FidelityRow(
        "Llama-3.1-8B FP16, 1000/1000",
        "held-out",
        "TensorRT-LLM 0.13",
        TRTLLM_013,
        "llama-3.1-8b",
        "a100-80g",
        1,
        THOUSANDS,
        3_592.16,
    ),
    FidelityRow(
        "Llama-3.1-8B FP8, 1000/1000",
        "held-out",
        "TensorRT-LLM 0.13",
        TRTLLM_013,
        "llama-3.1-8b",
        "l40s",
        1,
        THOUSANDS,
        3_648.21,
        FP8,
    ),
    FidelityRow(
        "Llama-3.1-70B FP8 TP4, 1000/1000",
        "held-out",
        "TensorRT-LLM 0.13",
        TRTLLM_013,
        "llama-3.1-70b",
        "h100",
        4,
        THOUSANDS,
        6_553.00,
        FP8,
    ),
    FidelityRow(
        "Mixtral-8x7B (MoE) FP16 TP4, 1000/1000",
        "held-out",
        "TensorRT-LLM 0.13",
        TRTLLM_013,
        "mixtral-8x7b",
        "a100-80g",
        4,
        THOUSANDS,
        7_461.63,
    ),
    FidelityRow(
        "Llama-3.1-8B FP8, 1000/1000",
        "held-out",
        "TensorRT-LLM 1.x",
        TRTLLM_1X,
        "llama-3.1-8b",
        "h200",
        1,
        THOUSANDS,
        17_744,
        FP8,
    ),
    FidelityRow(
        "Qwen3-235B-A22B (MoE) FP8 TP8, 1000/1000",
        "held-out",
        "TensorRT-LLM 1.x",
        TRTLLM_1X,
        "qwen3-235b-a22b",
        "h100",
        8,
        THOUSANDS,
        14_898,
        FP8,
    ),
    FidelityRow(
        "DeepSeek-V3 (MoE, MLA) FP8 TP8, 200 × 1000/2000 at 10 req/s",
        "held-out",
        "SGLang 0.4.5.post3",
        SGLANG_0453,
        "deepseek-v3",
        "h200",
        8,
        OfflineSpec("random", 200, 1000, 2000, request_rate=10.0),
        3_141.22,
        CHECKPOINT_FP8,
    ),
    FidelityRow(
        "DeepSeek-V3 (MoE, MLA) FP8 TP8, 200 × 5000/1000 at 10 req/s",
        "held-out",
        "SGLang 0.4.5.post3",
        SGLANG_0453,
        "deepseek-v3",
        "h200",
        8,
        OfflineSpec("random", 200, 5000, 1000, request_rate=10.0),
        1_255.01,
        CHECKPOINT_FP8,
    ),
    FidelityRow(
        "DeepSeek-R1 (MoE, MLA) FP8 TP8, 200 × 1000/2000",
        "held-out",
        "vLLM 0.8.4",
        VLLM_084,
        "deepseek-v3",
        "h200",
        8,
        OfflineSpec("random", 200, 1000, 2000, request_rate=10.0),
        2_498.90,
        CHECKPOINT_FP8,
    ),
]

PREDICTIONS = [
    FidelityRow(
        name,
        "prediction",
        "—",
        "—",
        model,
        gpu,
        tp,
        spec,
        None,
        extra,
    )
    for name, model, gpu, tp, spec, extra in [
        ("Llama-3.1-8B, ShareGPT 1,000", "llama-3.1-8b", "l40s", 1, OfflineSpec("sharegpt"), {}),
        (
            "Llama-3.1-70B TP4, ShareGPT 1,000",
            "llama-3.1-70b",
            "h200",
            4,
            OfflineSpec("sharegpt"),
            {},
        ),
        (
            "Qwen2.5-72B FP8 TP4, ShareGPT 1,000",
            "qwen2.5-72b",
            "h100",
            4,
            OfflineSpec("sharegpt"),
            {"quantization": "fp8"},
        ),
        (
            "Llama-3.1-8B, 1024/1024 ×256",
            "llama-3.1-8b",
            "h100",
            1,
            OfflineSpec("random", 256, 1024, 1024),
            {},
        ),
        # Profiled triples (vidur's A100 timings): both cost models side by side.
        (
            "Llama-3.1-8B, ShareGPT 1,000",
            "llama-3.1-8b",
            "a100-80g",
            1,
            OfflineSpec("sharegpt"),
            {},
        ),
        (
            "Llama-3.1-8B TP2, 1024/1024 ×256",
            "llama-3.1-8b",
            "a100-80g",
            2,
            OfflineSpec("random", 256, 1024, 1024),
            {},
        ),
    ]
]

ROWS = FIT + HELD_OUT + PREDICTIONS
