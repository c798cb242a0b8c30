"""Online calibration: the kvfleet policy starts from priors it derives from what a deployment
knows (the model's config.json and the GPU's datasheet, `routing/priors.py`) and learns the
prefill rate and decode step the replicas actually show. Each case here starts at least 2×
off the truth on both (set outright where the roofline prior happens to land close), and the
truth is the simulator's cost model, which the policy never reads: measured GPU timings
(vidur's, `kvfleet_sim/measured.py`) where the model, GPU and TP were profiled — a truth of
another form than the gateway's roofline prior — and a roofline of other constants elsewhere."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from kvfleet_gateway.routing import KvfleetTuning
from kvfleet_gateway.routing.kvfleet import KvfleetPolicy
from kvfleet_gateway.routing.priors import LLAMA_3_1_8B, Priors, priors_for
from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig, derive_layout
from kvfleet_sim.costmodel import DEFAULT_PROFILE, StepShape
from kvfleet_sim.fleet.model import FleetConfig
from kvfleet_sim.fleet.routing import deployment_priors, routed_fleet
from kvfleet_sim.fleet.traces import RateTrace
from kvfleet_sim.fleet.workloads import Workload, WorkloadSpec
from kvfleet_sim.measured import MeasuredCostModel, build_cost_model

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("operator/kvfleet_operator", "gateway/kvfleet_gateway", "cli/kvfleet_cli")


def truth(engine: EngineConfig) -> tuple[float, float]:
    """The simulated replica's prefill rate (2,048 uncached tokens alone) and decode step
    (16 requests of 1,500 tokens), from the cost model the policy is scored on."""
    cost = build_cost_model(derive_layout(engine), DEFAULT_PROFILE)
    n = 2048
    shape = StepShape(n, 1, StepShape.prefill_pairs(n, 0))
    return n / cost.step_time(shape), cost.step_time(
        StepShape(decode_seqs=16, decode_ctx_tokens=24_000)
    )


def routed(engine: EngineConfig, replicas: int, n: int, rate: float, **kw: object) -> KvfleetPolicy:
    """The kvfleet policy after routing `n` shared-prefix requests through the fleet."""
    tuning = KvfleetTuning(**kw)  # type: ignore[arg-type]
    sim = routed_fleet(FleetConfig(engine, replicas=replicas), "kvfleet", tuning)
    spec = WorkloadSpec("generated-shared-prefix", n, seed=1)
    sim.run(Workload(spec, RateTrace("poisson", rate=rate), engine.model.vocab_size))
    assert isinstance(sim.policy, KvfleetPolicy)
    return sim.policy


def step_of(policy: KvfleetPolicy, base: float, kv_read: float, scale: float) -> float:
    return (base + 16 * policy._avg_kv * kv_read) * scale


@pytest.mark.parametrize(
    ("model", "gpu", "tp", "off"),
    [
        ("llama-3.1-70b", "h200", 4, 2.5),  # starts 2.5× too fast
        ("llama-3.1-70b", "h200", 4, 0.4),  # starts 2.5× too slow
        ("llama-3.1-8b", "h100", 1, 3.0),
        ("llama-3.1-8b", "h100", 1, 1 / 3),
        # The measured truth: vidur's A100 timings, a step of another form than the prior's.
        ("llama-3.1-8b", "a100-80g", 1, 3.0),
        ("llama-3.1-8b", "a100-80g", 1, 1 / 3),
        ("llama-3.1-8b", "a100-80g", 2, 3.0),
    ],
)
def test_the_policy_learns_what_the_replicas_show_from_priors_far_off(
    model: str, gpu: str, tp: int, off: float
) -> None:
    engine = EngineConfig.for_model(BUILTIN.model(model), BUILTIN.gpu(gpu), tp_size=tp)
    measured = isinstance(
        build_cost_model(derive_layout(engine), DEFAULT_PROFILE), MeasuredCostModel
    )
    assert measured == (gpu == "a100-80g")
    rate, step = truth(engine)
    # The roofline prior's split of a decode step (weights vs KV), scaled `off` × too fast or
    # slow: calibration learns one scale on the step (the split is physics, the level is not).
    prior = deployment_priors(engine)
    prior_step = prior.decode_step_base_s + 24_000 * prior.kv_read_s_per_token
    k = step / off / prior_step
    start_rate = rate * off
    start_base, start_kv = prior.decode_step_base_s * k, prior.kv_read_s_per_token * k
    policy = routed(
        engine,
        4,
        400,
        10.0,
        prefill_tokens_per_second=start_rate,
        decode_step_base_s=start_base,
        kv_read_s_per_token=start_kv,
    )
    started = step_of(policy, start_base, start_kv, 1.0)
    assert max(rate / start_rate, start_rate / rate) >= 2.0
    assert max(step / started, started / step) >= 2.0 * 0.8  # (the mean KV footprint moved)
    learned = step_of(
        policy, policy.decode_step_base_s, policy.kv_read_s_per_token, policy.step_scale
    )
    assert policy.prefill_rate == pytest.approx(rate, rel=0.25)
    assert learned == pytest.approx(step, rel=0.15)


@pytest.mark.parametrize(
    ("model", "gpu", "tp"),
    [
        ("llama-3.1-70b", "h200", 4),
        ("llama-3.1-8b", "h100", 1),
        ("llama-3.1-8b", "l40s", 1),
        ("llama-3.1-8b", "a100-80g", 1),
    ],
)
def test_the_roofline_priors_are_the_right_order_of_magnitude(
    model: str, gpu: str, tp: int
) -> None:
    """What the calibration above has to correct when nothing is set: within 3× of the truth
    (a round 50% of peak, fitted to nothing)."""
    engine = EngineConfig.for_model(BUILTIN.model(model), BUILTIN.gpu(gpu), tp_size=tp)
    rate, step = truth(engine)
    p = deployment_priors(engine)
    prior_step = p.decode_step_base_s + 24_000 * p.kv_read_s_per_token
    assert 1 / 3 < p.prefill_tokens_per_second / rate < 3
    assert 1 / 3 < prior_step / step < 3


def test_the_gateway_derives_its_priors_from_a_config_json(tmp_path: Path) -> None:
    models = ROOT / "tests" / "data" / "models"
    seventy = priors_for(str(models / "llama-3.3-70b"), "h100", 4, 0.5)
    eight = priors_for(None, "h100", 1, 0.5)
    assert isinstance(eight, Priors) and "Llama-3.1-8B" in eight.basis
    # 2 FLOPs per active parameter at half of 4 × 989 TFLOP/s; the weights' bytes at half of
    # 4 × 3.35 TB/s; KV: 80 layers × 8 heads × 128 × K and V × 2 bytes.
    expected_rate = 0.5 * 4 * 989e12 / 2 / 69.5e9
    assert seventy.prefill_tokens_per_second == pytest.approx(expected_rate, rel=0.02)
    assert seventy.decode_step_base_s == pytest.approx(70.6e9 * 2 / (0.5 * 4 * 3.35e12), rel=0.01)
    assert seventy.kv_read_s_per_token == pytest.approx(327_680 / (0.5 * 4 * 3.35e12))
    assert LLAMA_3_1_8B.kv_bytes_per_token == 131_072
    policy = KvfleetPolicy(KvfleetTuning(prefill_tokens_per_second=1234.0))
    assert policy.prefill_rate == 1234.0  # a set value overrides its part of the prior
    assert policy.decode_step_base_s == eight.decode_step_base_s
    with pytest.raises(ValueError, match="cannot read"):
        priors_for(str(tmp_path / "missing"), "h100", 1, 0.5)


def test_calibration_can_be_turned_off_and_ignores_untimed_requests() -> None:
    engine = EngineConfig.for_model(BUILTIN.model("llama-3.1-70b"), BUILTIN.gpu("h200"), tp_size=4)
    policy = routed(engine, 2, 100, 5.0, calibrate=False)
    assert policy.prefill_rate == deployment_priors(engine).prefill_tokens_per_second
    assert policy.step_scale == 1.0 and not policy._probes  # every probe was let go


def _cost_model_outputs() -> list[float]:
    """Numbers the simulator's cost model produces for every catalogued model and GPU it can
    fit: prefill rates, decode steps and per-token KV read times, as a product module would
    embed them had it been tuned on the simulator."""
    out: list[float] = []
    for model in BUILTIN.models.values():
        for gpu in BUILTIN.gpus.values():
            for tp in (1, 2, 4, 8):
                try:
                    engine = EngineConfig.for_model(model, gpu, tp_size=tp)
                    rate, step = truth(engine)
                except ValueError:
                    continue  # does not fit
                layout = derive_layout(engine)
                cost = build_cost_model(layout, DEFAULT_PROFILE)
                idle = cost.step_time(StepShape(decode_seqs=1, decode_ctx_tokens=1))
                per_kv = (step - idle) / 24_000
                out += [rate, step, idle, per_kv]
    return [x for x in out if x > 0 and math.isfinite(x)]


POLICY_MODULES = (
    "gateway/kvfleet_gateway/routing",
    "operator/kvfleet_operator/scaling",
)
"""Where numbers model a replica's speed: the routing policies and the autoscaler."""


def _numbers_in(source: str) -> list[tuple[int, float]]:
    """Float literals, less the bounds of a setting (`minimum=`, `maximum=`)."""
    tree = ast.parse(source)
    bounds = {
        id(k.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for k in node.keywords
        if k.arg in ("minimum", "maximum")
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and type(node.value) is float and id(node) not in bounds
    ]


CHOSEN = {0.05}
"""Round constants that are not speeds and near-match an output by coincidence: 0.05 is the
routing score's smoothing gain and the autoscaler's idle-rate floor (requests per second per
replica), both older than the catalogue's Qwen3-32B, whose idle decode step on one A100 the
cost model puts at 49 ms."""


def _matches(source: str, outputs: list[float]) -> list[tuple[int, float]]:
    return [
        (line, x)
        for line, x in _numbers_in(source)
        if x not in CHOSEN and any(abs(x - o) <= 0.03 * o for o in outputs)
    ]


def test_no_policy_module_embeds_a_number_the_cost_model_produces() -> None:
    """A float in a policy module within 3% of what the simulator's cost model computes for
    some catalogued deployment (a prefill rate, a decode step, a KV read time) was most likely
    read off the simulator that scores it. Datasheet inputs (GPU peaks) are inputs of both,
    not outputs, and do not match; the gains and tolerances there (0.05, 0.25) match none."""
    outputs = _cost_model_outputs()
    assert len(outputs) > 50
    hits = [
        f"{f.relative_to(ROOT)}:{line}: {value!r}"
        for pkg in POLICY_MODULES
        for f in sorted((ROOT / pkg).rglob("*.py"))
        for line, value in _matches(f.read_text(), outputs)
    ]
    assert not hits, "numbers that match the simulator's cost model:\n" + "\n".join(hits)


def test_the_embedded_number_check_can_fail() -> None:
    """The previous release's priors (30,000 tok/s, a 10 ms decode step, 5.6e-8 s per KV
    token: the simulator's own output for Llama-3.1-8B on an H100) are each caught."""
    old = """
prefill_tokens_per_second: float = fld(30_000.0, "...", minimum=1)
decode_step_base_s: float = fld(0.010, "...", minimum=0.01)
kv_read_s_per_token: float = fld(5.6e-8, "...")
"""
    assert [line for line, _ in _matches(old, _cost_model_outputs())] == [2, 3, 4]
