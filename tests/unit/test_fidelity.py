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


def test_held_out_rows_cover_what_a_reader_would_check() -> None:
    """Held-out rows: at least six published results no constant was fitted to, from at least
    three sources and three engines, dense and MoE models, at least two GPU types, each with
    its source; none shares a source with a fit row."""
    from kvfleet_bench.fidelity_rows import FIT, HELD_OUT

    assert len(HELD_OUT) >= 6
    assert len({r.source for r in HELD_OUT}) >= 3
    assert len({r.engine.split()[0] for r in HELD_OUT}) >= 3  # TensorRT-LLM, SGLang, vLLM
    assert {r.moe for r in HELD_OUT} == {True, False}
    assert len({r.gpu for r in HELD_OUT}) >= 2
    assert all(r.published and r.source and r.profile == "sglang" for r in HELD_OUT)
    assert not {r.source for r in HELD_OUT} & {r.source for r in FIT}


def test_a_held_out_row_is_scored_against_its_published_number() -> None:
    """The report's error is simulated / published - 1 on the row's own configuration (the
    MoE + MLA row at 10 req/s, a model read from the bench's config.json)."""
    from kvfleet_bench.fidelity import fidelity, held_out_summary
    from kvfleet_bench.fidelity_rows import HELD_OUT

    row = next(r for r in HELD_OUT if r.spec.request_rate and r.spec.input_len == 5000)
    [scored] = fidelity(lambda _: None, [row])
    assert scored["moe"] and scored["kind"] == "held-out"
    assert scored["error"] == pytest.approx(scored["simulated"] / row.published - 1)
    summary = held_out_summary([scored])
    assert summary["worst"] is scored
    assert summary["within_band"] == (abs(scored["error"]) <= 0.25)


def test_a_request_rate_spreads_arrivals_as_bench_serving_does() -> None:
    """At 1 req/s, 20 short requests cannot finish before the last one arrives (~19 s), and
    all at once they finish in well under a second of simulated time."""
    config = cfg("llama-3.1-8b", "h100")
    burst = run_offline(config, OfflineSpec("random", 20, 64, 8))
    paced = run_offline(config, OfflineSpec("random", 20, 64, 8, request_rate=1.0))
    assert burst.duration_s < 1.0
    assert 10.0 < paced.duration_s < 40.0
    assert paced.output_tokens == burst.output_tokens == 160
    with pytest.raises(ValueError, match="request_rate"):
        run_offline(config, OfflineSpec("random", 2, 64, 8, request_rate=0.0))
