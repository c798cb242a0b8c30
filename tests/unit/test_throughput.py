"""The gateway's roofline of a replica at the request mix (`routing/throughput.py`), which the
autoscaler plans from before the fleet has shown where its limit is: the formula by hand, then
against what a simulated replica really completes flat out (a number the policy never reads),
and the check failing on a policy whose speeds are wrong."""

from __future__ import annotations

import statistics

import pytest

from kvfleet_gateway.routing import KvfleetTuning
from kvfleet_gateway.routing.kvfleet import MIN_MIX_SAMPLES, KvfleetPolicy
from kvfleet_gateway.routing.throughput import RequestMix, replica_throughput
from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig
from kvfleet_sim.fleet.model import FleetConfig
from kvfleet_sim.fleet.routing import deployment_priors, routed_fleet
from kvfleet_sim.fleet.traces import RateTrace
from kvfleet_sim.fleet.workloads import Workload, WorkloadSpec


def test_the_roofline_by_hand() -> None:
    mix = RequestMix(uncached_tokens=1000, output_tokens=200, kv_tokens=1100)
    # The KV cache holds 100 such requests: a step reads 110,000 tokens of KV (0.11 s) on top
    # of 0.01 s of weights; each request's 200 steps are shared by 100: 0.24 s, plus 0.1 s of
    # its own prefill at 10,000 tokens a second.
    assert replica_throughput(mix, 10_000, 0.01, 1e-6, 110_000) == pytest.approx(1 / 0.34)
    # Ten batch slots bind first: steps are short (0.021 s) but shared by only 10.
    assert replica_throughput(mix, 10_000, 0.01, 1e-6, 110_000, slots=10) == pytest.approx(
        1 / (0.1 + 200 * 0.021 / 10)
    )
    # A cache too small for one request still runs one at a time.
    alone = replica_throughput(mix, 10_000, 0.01, 1e-6, 500)
    assert alone == pytest.approx(1 / (0.1 + 200 * (0.01 + 1100e-6)))


def test_the_policy_reports_a_throughput_once_the_mix_is_known() -> None:
    policy = KvfleetPolicy(KvfleetTuning(max_running_requests=8))
    for _ in range(MIN_MIX_SAMPLES - 1):
        policy.observe_work(prompt_tokens=1200, cached_tokens=200, output_tokens=200)
    assert policy.throughput(110_000) is None  # too few finished requests to say
    policy.observe_work(prompt_tokens=1200, cached_tokens=200, output_tokens=200)
    assert policy.mix == RequestMix(1000, 200, 1300)
    p = policy.priors
    step = p.decode_step_base_s + 8 * 1300 * p.kv_read_s_per_token  # the 8 slots bind
    expected = 1 / (1000 / p.prefill_tokens_per_second + 200 * step / 8)
    assert policy.throughput(110_000) == pytest.approx(expected)
    # One odd request moves the mix by a share, not all the way (output lengths are
    # heavy-tailed): a plain mean of the 21 so far.
    policy.observe_work(prompt_tokens=1200, cached_tokens=200, output_tokens=4400)
    assert policy.mix is not None and policy.mix.output_tokens == pytest.approx(400)


def flat_out(model: str, gpu: str, tp: int, **tuning: object) -> tuple[float, list[float]]:
    """A replica under a ShareGPT-like load far over what it serves: the requests it
    completes per second (the middle of the run, away from its start and drain) and what
    the gateway's policy estimated meanwhile."""
    engine = EngineConfig.for_model(BUILTIN.model(model), BUILTIN.gpu(gpu), tp_size=tp)
    sim = routed_fleet(FleetConfig(engine, replicas=1), "kvfleet", KvfleetTuning(**tuning))  # type: ignore[arg-type]
    spec = WorkloadSpec("sharegpt", 3000, seed=1)
    estimates: list[tuple[float, float]] = []
    report = sim._report_work

    def reported(gateway: int, rep: object, req: object) -> None:
        report(gateway, rep, req)  # type: ignore[arg-type]
        bound = sim.replica_throughput()
        if bound is not None:
            estimates.append((sim.clock.t, bound))

    sim._report_work = reported  # type: ignore[method-assign]
    sim.run(Workload(spec, RateTrace("poisson", rate=100.0), engine.model.vocab_size))
    finished = sorted(r.finish for r in sim.collector.records)
    first, last = len(finished) // 6, 4 * len(finished) // 6
    start, end = finished[first], finished[last]
    return (last - first) / (end - start), [b for t, b in estimates if start <= t <= end]


@pytest.mark.parametrize(
    ("model", "gpu", "tp"),
    [("llama-3.1-8b", "h100", 1), ("llama-3.1-70b", "h200", 4), ("qwen3-32b", "h100", 2)],
)
def test_the_estimate_is_a_conservative_bound_of_what_a_replica_completes(
    model: str, gpu: str, tp: int
) -> None:
    """Calibrated from the priors (nothing set), the median estimate stays under what the
    replica completes flat out (a roofline leaves out the prefill chunks' interference, which
    the calibrated decode step partly counts again) and within 2× of it; nine in ten stay
    within 1.2× of it."""
    completed, estimates = flat_out(model, gpu, tp)
    deciles = [q / completed for q in statistics.quantiles(estimates, n=10)]
    print(
        f"{model}: completes {completed:.1f} req/s; estimate deciles", [f"{d:.2f}" for d in deciles]
    )
    assert 0.5 < deciles[4] < 1.05  # the median
    assert deciles[-1] < 1.2  # the 90th percentile: over it only while calibration settles


def test_the_bound_check_fails_on_a_policy_whose_speeds_are_wrong() -> None:
    """The same check on a policy told its replicas are 3× faster than they are and kept
    from calibrating: its estimate is far over what the replica completes."""
    engine = EngineConfig.for_model(BUILTIN.model("llama-3.1-8b"), BUILTIN.gpu("h100"))
    p = deployment_priors(engine)
    completed, estimates = flat_out(
        "llama-3.1-8b", "h100", 1, calibrate=False,
        prefill_tokens_per_second=3 * p.prefill_tokens_per_second,
        decode_step_base_s=p.decode_step_base_s / 3,
        kv_read_s_per_token=p.kv_read_s_per_token / 3,
    )  # fmt: skip
    assert statistics.median(estimates) / completed > 1.5
