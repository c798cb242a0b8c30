"""The simulator reproduces published GPU results within ±25% (the rows of
bench/results/sim-fidelity.md, each with its source)."""

import pytest

from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig
from kvfleet_sim.offline import OfflineSpec, run_offline


def cfg(model: str, gpu: str, **kw: object) -> EngineConfig:
    return EngineConfig(model=BUILTIN.model(model), gpu=BUILTIN.gpu(gpu), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("inp", "out", "batch", "published"),
    [
        (128, 128, 896, 20_404),
        (2048, 2048, 56, 3_731),
    ],
)
def test_trtllm_mistral_fp8_static_batches(
    inp: int, out: int, batch: int, published: float
) -> None:
    """TensorRT-LLM 0.9 table, one H100, FP8 (weights and KV), static batches."""
    config = cfg(
        "mistral-7b",
        "h100",
        quantization="fp8",
        kv_cache_dtype="fp8_e4m3",
        max_running_requests=batch,
    )
    result = run_offline(config, OfflineSpec("random", batch, inp, out), profile="trtllm-0.9")
    assert result.output_throughput == pytest.approx(published, rel=0.25)


def test_sglang_llama3_8b_tp2_sharegpt() -> None:
    """sglang#1639: Llama-3-8B, TP2 on two H100s, 2,000 ShareGPT prompts at once."""
    result = run_offline(cfg("llama-3.1-8b", "h100", tp_size=2), OfflineSpec("sharegpt", 2000))
    assert result.input_tokens / 2000 == pytest.approx(227, rel=0.05)
    assert result.output_tokens / 2000 == pytest.approx(188, rel=0.05)
    assert result.output_throughput == pytest.approx(10_897, rel=0.25)
    assert result.request_throughput == pytest.approx(57.9, rel=0.25)
    assert result.total_throughput == pytest.approx(24_023, rel=0.25)
