"""The cost model behaves like the hardware: which resource bounds each phase, and how much."""

import pytest

from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig, derive_layout
from kvfleet_sim.costmodel import PROFILES, RooflineCostModel, StepShape
from kvfleet_sim.engine import Engine, VirtualClock
from kvfleet_sim.request import Request


def model_for(tp: int = 1, model: str = "llama-3.1-8b", gpu: str = "h100") -> RooflineCostModel:
    cfg = EngineConfig(model=BUILTIN.model(model), gpu=BUILTIN.gpu(gpu), tp_size=tp)
    return RooflineCostModel(derive_layout(cfg), PROFILES["sglang"])


def decode(batch: int, ctx: int) -> StepShape:
    return StepShape(decode_seqs=batch, decode_ctx_tokens=batch * ctx)


def prefill(tokens: int, cached: int = 0) -> StepShape:
    return StepShape(
        prefill_tokens=tokens,
        prefill_seqs=1,
        prefill_attn_pairs=StepShape.prefill_pairs(tokens, cached),
        prefill_ctx_tokens=cached,
    )


def test_decode_is_bandwidth_bound_and_grows_with_kv_bytes() -> None:
    cm = model_for()
    small, large = cm.step_cost(decode(32, 1000)), cm.step_cost(decode(32, 8000))
    assert small.linear_bound == "memory"
    assert small.attention_bound == "memory"
    # 7,000 more tokens of KV per request: 32 × 7000 × 128 KiB read at 70% of 3.35 TB/s.
    extra = 32 * 7000 * 128 * 1024 / (3.35e12 * 0.70)
    assert large.total_s - small.total_s == pytest.approx(extra, rel=0.02)
    # Weight streaming sets the floor: a batch of 1 costs ~16 GB / (0.7 × 3.35 TB/s).
    one = cm.step_cost(decode(1, 100))
    assert one.linear_s == pytest.approx(16.06e9 / (3.35e12 * 0.70), rel=0.02)


def test_prefill_is_compute_bound() -> None:
    cost = model_for().step_cost(prefill(8192))
    assert cost.linear_bound == "compute"
    assert cost.dominant().startswith("linear (compute)")
    # 2 × 6.98e9 body params × 8192 tokens at 45% of 989 TFLOP/s ≈ 0.26 s
    assert cost.linear_s == pytest.approx(2 * 6.98e9 * 8192 / (989e12 * 0.45), rel=0.03)


def test_tensor_parallel_lowers_step_time_but_adds_all_reduce() -> None:
    shape = prefill(4096)
    tp1, tp2, tp4 = (model_for(tp).step_cost(shape) for tp in (1, 2, 4))
    assert tp1.allreduce_s == 0
    assert tp2.allreduce_s > 0
    assert tp4.allreduce_s > tp2.allreduce_s
    assert tp4.total_s < tp2.total_s < tp1.total_s
    # Not a perfect split: communication keeps the speed-up below the GPU count.
    assert tp1.total_s / tp4.total_s < 4


def test_fp8_runs_matmuls_at_the_fp8_rate() -> None:
    base = EngineConfig(model=BUILTIN.model("llama-3.1-8b"), gpu=BUILTIN.gpu("h100"))
    fp8 = EngineConfig(model=base.model, gpu=base.gpu, quantization="fp8")
    b = RooflineCostModel(derive_layout(base), PROFILES["sglang"]).step_cost(prefill(8192))
    f = RooflineCostModel(derive_layout(fp8), PROFILES["sglang"]).step_cost(prefill(8192))
    assert f.linear_s == pytest.approx(b.linear_s / 2, rel=0.05)


def ttft_of_second(cached_share: float) -> tuple[float, float, int]:
    """TTFT of a 4,096-token prompt after a first request that shares `cached_share` of it."""
    clock = VirtualClock()
    engine = Engine(
        EngineConfig(model=BUILTIN.model("llama-3.1-8b"), gpu=BUILTIN.gpu("h100")), clock
    )
    shared = int(4096 * cached_share)
    first = list(range(1, 4097))
    second = first[:shared] + list(range(100_000, 100_000 + 4096 - shared))
    engine.submit(Request("a", first, 1, arrival_time=0.0))
    engine.run_until_idle(clock)
    start = clock.t
    req = Request("b", second, 1, arrival_time=start)
    engine.submit(req)
    engine.run_until_idle(clock)
    assert req.first_token_time is not None
    cold = Request("c", list(range(200_000, 204_096)), 1, arrival_time=clock.t)
    engine.submit(cold)
    engine.run_until_idle(clock)
    assert cold.first_token_time is not None
    return (
        req.first_token_time - start,
        cold.first_token_time - cold.arrival_time,
        req.cached_tokens,
    )


@pytest.mark.parametrize("share", [0.5, 0.9])
def test_prefix_hits_cut_ttft_by_the_cached_share(share: float) -> None:
    warm, cold, cached = ttft_of_second(share)
    assert cached == int(4096 * share)
    # Compute scales with the uncached share; fixed step overhead keeps a small floor.
    assert warm / cold == pytest.approx(1 - share, abs=0.06)
