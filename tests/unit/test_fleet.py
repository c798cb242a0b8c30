"""The fleet simulator: deterministic, measures what it claims, scales with cold starts."""

import random
from collections.abc import Sequence

import pytest

from kvfleet_gateway.routing import Candidate, RouteRequest, make_policy
from kvfleet_gateway.routing.base import Stateless
from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig
from kvfleet_sim.fleet.collector import percentile
from kvfleet_sim.fleet.des import FleetSimulator
from kvfleet_sim.fleet.model import FleetConfig, FleetView, Target
from kvfleet_sim.fleet.traces import RateTrace
from kvfleet_sim.fleet.workloads import Workload, WorkloadSpec

ENGINE = EngineConfig(model=BUILTIN.model("llama-3.1-8b"), gpu=BUILTIN.gpu("h100"))


def run(
    kind: str = "generated-shared-prefix",
    n: int = 300,
    rate: float = 20.0,
    replicas: int = 4,
    router: object = None,
    **spec: object,
):  # type: ignore[no-untyped-def]
    workload = Workload(WorkloadSpec(kind, n, **spec), RateTrace("poisson", rate), 128_256)  # type: ignore[arg-type]
    sim = FleetSimulator(
        FleetConfig(ENGINE, replicas=replicas), router or make_policy("round_robin")
    )  # type: ignore[arg-type]
    return sim.run(workload)


def test_same_seed_same_result() -> None:
    a, b = run(n=200).summary, run(n=200).summary
    assert a == b
    c = run(n=200, seed=2).summary
    assert c != a


def test_every_request_is_measured_once() -> None:
    result = run(n=256)
    s = result.summary
    assert s.requests == 256 == len(result.records)
    assert all(r.output_tokens == 256 for r in result.records)  # gsp default output
    assert 0 < s.ttft_p50 <= s.ttft_p99 and s.tpot_p50 > 0
    assert s.output_throughput == pytest.approx(256 * 256 / s.duration_s, rel=1e-9)
    # GPU-seconds bill every replica for the whole run, idle or not.
    assert s.gpu_seconds == pytest.approx(4 * (max(r.finish for r in result.records)), rel=1e-6)


def test_shared_prefix_hits_the_cache() -> None:
    n = 1024
    s = run(n=n).summary
    # Each replica misses each of the 64 system prompts once (round robin spreads them all),
    # and at most 2048 of a request's 2176 tokens can be cached.
    ceiling = (n - 64 * 4) / n * 2048 / 2176
    assert ceiling * 0.9 < s.cache_hit_rate <= ceiling + 1e-9
    assert run("random", n=200, input_len=512, output_len=64).summary.cache_hit_rate < 0.01


def test_multi_turn_follow_ups_reuse_their_history() -> None:
    one = run("multi-turn", n=200, rate=2.0, replicas=1, turns=4)
    assert one.summary.requests == 200
    # On a single replica every later turn finds its whole history cached.
    assert one.summary.cache_hit_rate > 0.5


def test_imbalance_is_zero_when_even_and_high_when_one_replica_gets_everything() -> None:
    class AlwaysFirst(Stateless):
        name = "first"

        def choose(self, req: RouteRequest, candidates: Sequence[Candidate]) -> str:
            return min(c.key for c in candidates)

    assert run(n=200, router=make_policy("least_load")).summary.imbalance < 0.1
    assert run(n=200, router=AlwaysFirst()).summary.imbalance > 0.7


def test_scaler_adds_replicas_after_the_cold_start() -> None:
    class QueueScaler:
        def target(self, view: FleetView) -> Target:
            queued = sum(r.load.num_waiting_reqs for r in view.active)
            return Target(len(view.active) + view.starting + (1 if queued > 0 else 0))

    workload = Workload(
        WorkloadSpec("random", 3000, input_len=2048, output_len=256),
        RateTrace("poisson", 40.0),
        128_256,
    )
    cfg = FleetConfig(ENGINE, replicas=1, cold_start_s=30.0, scale_interval_s=5.0)
    result = FleetSimulator(cfg, make_policy("least_load"), QueueScaler()).run(workload)
    trace = result.replica_count_trace
    assert max(n for _, n in trace) > 1
    first_add = next(t for t, n in trace if n > 1)
    assert first_add >= 5.0
    assert len(result.replica_busy_s) > 1


@pytest.mark.parametrize("kind", ["poisson", "step", "ramp", "bursts"])
def test_traces_have_the_rate_they_say(kind: str) -> None:
    trace = RateTrace(kind, rate=10.0, peak_rate=30.0, start_s=100.0, duration_s=100.0)  # type: ignore[arg-type]
    times = trace.arrivals(4000, random.Random(3))
    assert times == sorted(times)
    window = [t for t in times if 20 <= t < 80]
    expected = {"poisson": 10.0, "step": 10.0, "ramp": 10 + 20 * 0.5, "bursts": 10.0}[kind]
    assert len(window) / 60 == pytest.approx(expected, rel=0.2)
    if kind == "step":
        spike = [t for t in times if 100 <= t < 200]
        assert len(spike) / 100 == pytest.approx(30.0, rel=0.15)


def test_percentile_nearest_rank() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0
    assert percentile(list(map(float, range(1, 101))), 99) == 99.0


def test_gateways_behind_a_service_each_see_their_own_share() -> None:
    """Requests spread round robin over gateway replicas, each with its own policy (its own
    prefix index and in-flight counts): every request is served once, each gateway routes
    its share, and cache affinity learned separately hits less than one gateway's."""
    seen: list[list[int]] = []

    class Counting(Stateless):
        name = "counting"

        def __init__(self) -> None:
            self.inflight_seen: list[int] = []
            seen.append(self.inflight_seen)

        def choose(self, req: RouteRequest, candidates: Sequence[Candidate]) -> str:
            self.inflight_seen.append(sum(c.inflight_requests for c in candidates))
            return candidates[len(self.inflight_seen) % len(candidates)].key

    workload = Workload(WorkloadSpec(num_requests=400), RateTrace("poisson", 40.0), 128_256)
    sim = FleetSimulator(FleetConfig(ENGINE, replicas=4), make_policy("round_robin"))
    sim.behind_gateways([Counting(), Counting()])
    assert sim.run(workload).summary.requests == 400
    assert [len(s) for s in seen] == [200, 200]
    assert max(max(s) for s in seen) < 200  # each counts only its own in-flight requests

    def hit(gateways: int) -> float:
        w = Workload(WorkloadSpec(num_requests=600), RateTrace("poisson", 30.0), 128_256)
        sim = FleetSimulator(FleetConfig(ENGINE, replicas=4), make_policy("round_robin"))
        sim.behind_gateways([make_policy("sglang_cache_aware") for _ in range(gateways)])
        return sim.run(w).summary.cache_hit_rate

    assert hit(4) < hit(1)


def test_a_prompt_the_engine_cannot_hold_is_refused_and_counted_not_a_crash() -> None:
    """Random prompts of 30k–120k tokens against Llama-3.1-70B at TP2 on H100 (a KV pool of
    ~23k tokens): SGLang answers each one too long with 400 and its message; the fleet counts
    them, runs the rest, and releases every refused request's in-flight bookkeeping."""
    engine = EngineConfig(model=BUILTIN.model("llama-3.1-70b"), gpu=BUILTIN.gpu("h100"), tp_size=2)
    spec = WorkloadSpec("random", 40, input_len=120_000, output_len=64, range_ratio=0.125)
    sim = FleetSimulator(FleetConfig(engine, replicas=2), make_policy("least_load"))
    result = sim.run(Workload(spec, RateTrace("poisson", 2.0), 128_256))
    s = result.summary
    longest = sim.replicas[0].engine.layout.max_req_input_len
    too_long = [r for r in result.refused if r.prompt_tokens > longest]
    assert s.refused == len(result.refused) == len(too_long) > 0
    assert s.requests == len(result.records) > 0 and s.requests + s.refused == 40
    assert all(r.prompt_tokens <= longest for r in result.records)
    first = result.refused[0]
    assert first.status == 400
    assert first.message == (
        f"Input length ({first.prompt_tokens} tokens) exceeds the maximum allowed length "
        f"({longest} tokens). Use a shorter input."
    )
    assert s.refusal == f"400: {first.message}"
    assert all(r.inflight_requests == 0 == r.inflight_tokens for r in sim.replicas)
