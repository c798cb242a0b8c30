"""Online calibration: the kvfleet policy starts from its priors (an 8B model on one H100) and
learns the prefill rate and decode step the replicas actually show, so a 70B service on H200s
does not route with an 8B model's numbers. Measured against the simulator's own cost model,
which the policy never reads."""

from __future__ import annotations

import pytest

from kvfleet_gateway.routing import KvfleetTuning
from kvfleet_gateway.routing.kvfleet import KvfleetPolicy
from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig, derive_layout
from kvfleet_sim.costmodel import DEFAULT_PROFILE, PROFILES, RooflineCostModel, StepShape
from kvfleet_sim.fleet.des import FleetConfig
from kvfleet_sim.fleet.routing import routed_fleet
from kvfleet_sim.fleet.traces import RateTrace
from kvfleet_sim.fleet.workloads import Workload, WorkloadSpec


def truth(engine: EngineConfig) -> tuple[float, float]:
    """The simulated replica's prefill rate (2,048 uncached tokens alone) and decode step
    (16 requests of 1,500 tokens), from the cost model the policy is scored on."""
    cost = RooflineCostModel(derive_layout(engine), PROFILES[DEFAULT_PROFILE])
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


@pytest.mark.parametrize(
    ("model", "gpu", "tp"), [("llama-3.1-70b", "h200", 4), ("llama-3.1-8b", "h100", 1)]
)
def test_the_policy_learns_what_the_replicas_show(model: str, gpu: str, tp: int) -> None:
    engine = EngineConfig.for_model(BUILTIN.model(model), BUILTIN.gpu(gpu), tp_size=tp)
    policy = routed(engine, 4, 400, 10.0)
    rate, step = truth(engine)
    t = policy.tuning
    learned_step = (
        t.decode_step_base_s + 16 * policy._avg_kv * t.kv_read_s_per_token
    ) * policy.step_scale
    assert policy.prefill_rate == pytest.approx(rate, rel=0.25)
    assert learned_step == pytest.approx(step, rel=0.15)


def test_calibration_can_be_turned_off_and_ignores_untimed_requests() -> None:
    engine = EngineConfig.for_model(BUILTIN.model("llama-3.1-70b"), BUILTIN.gpu("h200"), tp_size=4)
    policy = routed(engine, 2, 100, 5.0, calibrate=False)
    assert policy.prefill_rate == KvfleetTuning().prefill_tokens_per_second
    assert policy.step_scale == 1.0 and not policy._probes  # every probe was let go
