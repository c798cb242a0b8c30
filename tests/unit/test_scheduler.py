"""SGLang's scheduling behaviour in virtual time: batching, chunking, budgets, retraction."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig
from kvfleet_sim.engine import Engine, VirtualClock
from kvfleet_sim.request import Request


def engine(**kw: object) -> tuple[Engine, VirtualClock]:
    clock = VirtualClock()
    cfg = EngineConfig(model=BUILTIN.model("llama-3.1-8b"), gpu=BUILTIN.gpu("h100"), **kw)  # type: ignore[arg-type]
    return Engine(cfg, clock), clock


def req(i: int, n_in: int, n_out: int, t: float = 0.0, base: int = 0) -> Request:
    return Request(
        f"r{i}", [base + i * 100_000 + k for k in range(n_in)], n_out, arrival_time=t, seed=i
    )


def run(e: Engine, clock: VirtualClock) -> list[str]:
    """Drive to idle; return the kind of each step ("P" prefill, "D" decode)."""
    kinds = []
    while (step := e.begin_step()) is not None:
        clock.t = step.start + step.duration
        kinds.append("P" if step.batch.is_prefill else "D")
        e.end_step(step)
    return kinds


def test_continuous_batching_admits_new_requests_between_decode_steps() -> None:
    e, clock = engine()
    e.submit(req(0, 100, 50))
    step = e.begin_step()
    assert step is not None
    clock.t += step.duration
    e.end_step(step)
    for _ in range(5):  # decode a few tokens of the first request
        s = e.begin_step()
        assert s is not None
        assert not s.batch.is_prefill
        clock.t += s.duration
        e.end_step(s)
    late = req(1, 100, 10, t=clock.t)
    e.submit(late)
    s = e.begin_step()
    assert s is not None
    assert s.batch.is_prefill
    assert s.batch.reqs == [late]
    clock.t += s.duration
    e.end_step(s)
    s = e.begin_step()
    assert s is not None
    assert len(s.batch.reqs) == 2


def test_long_prompt_is_chunked_and_gets_one_first_token() -> None:
    e, clock = engine(chunked_prefill_size=1000)
    r = req(0, 2500, 3)
    e.submit(r)
    kinds = run(e, clock)
    assert kinds[:3] == ["P", "P", "P"]  # 1000 + 1000 + 500
    assert r.output_len == 3
    assert r.finish_reason == "length"


def test_admission_respects_max_running_requests() -> None:
    e, clock = engine(max_running_requests=4)
    for i in range(10):
        e.submit(req(i, 50, 20))
    step = e.begin_step()
    assert step is not None
    assert len(step.batch.reqs) == 4
    clock.t += step.duration
    e.end_step(step)
    assert e.load().num_running_reqs == 4
    assert e.load().num_waiting_reqs == 6


def test_admission_budget_reserves_future_output() -> None:
    # A 20k-token pool: each request needs 1000 input + 5000 reserved output.
    e, _clock = engine(max_total_tokens=20_000)
    for i in range(6):
        e.submit(req(i, 1000, 5000))
    step = e.begin_step()
    assert step is not None
    assert len(step.batch.reqs) == 3  # 3 × 6000 ≤ 20000 < 4 × 6000


def test_retraction_when_decode_does_not_fit_then_everything_finishes() -> None:
    e, clock = engine(max_total_tokens=12_000)
    reqs = [req(i, 500, 4000) for i in range(8)]
    for r in reqs:
        e.submit(r)
    run(e, clock)
    assert e.scheduler.retracted_total > 0
    assert all(r.finish_reason == "length" and r.output_len == 4000 for r in reqs)
    assert e.scheduler.req_tokens == 0
    assert e.scheduler.cache.protected_size == 0


def test_shared_prefix_is_reused_while_the_first_request_still_decodes() -> None:
    e, clock = engine()
    system = list(range(1, 2049))
    a = Request("a", [*system, 5, 6, 7], 50, 0.0)
    e.submit(a)
    step = e.begin_step()
    assert step is not None
    clock.t += step.duration
    e.end_step(step)
    b = Request("b", [*system, 8, 9], 5, clock.t)
    e.submit(b)
    run(e, clock)
    assert b.cached_tokens == 2048


def test_lpm_schedules_the_longest_cached_prefix_first() -> None:
    e, clock = engine(schedule_policy="lpm", max_running_requests=1)
    warm = list(range(1, 1001))
    e.submit(Request("w", [*warm, 1], 1, 0.0))
    run(e, clock)
    cold = Request("cold", list(range(50_000, 51_000)), 1, clock.t)
    hot = Request("hot", [*warm, 2], 1, clock.t)
    e.submit(cold)
    e.submit(hot)
    step = e.begin_step()
    assert step is not None
    assert step.batch.reqs == [hot]


def test_abort_frees_memory_at_the_next_step() -> None:
    e, clock = engine()
    r = req(0, 1000, 1000)
    e.submit(r)
    step = e.begin_step()
    assert step is not None
    clock.t += step.duration
    e.end_step(step)
    e.abort(r)
    assert e.begin_step() is None
    assert r.finish_reason == "abort"
    assert e.scheduler.req_tokens == 0
    assert e.counters.aborted == 1


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["fcfs", "lpm"]), st.booleans())
def test_kv_accounting_never_drifts(seed: int, policy: str, radix_off: bool) -> None:
    """Random workloads on a tiny pool: every request ends, and the pool balances to zero."""
    rng = random.Random(seed)
    e, clock = engine(
        max_total_tokens=6000,
        chunked_prefill_size=512,
        schedule_policy=policy,
        disable_radix_cache=radix_off,
    )
    shared = [rng.randrange(1000) for _ in range(300)]
    reqs = []
    for i in range(30):
        prefix = shared[: rng.randrange(300)] if rng.random() < 0.6 else []
        prompt = prefix + [rng.randrange(1000) for _ in range(rng.randrange(1, 800))]
        reqs.append(Request(f"r{i}", prompt, rng.randrange(0, 400), arrival_time=0.0, seed=i))
    for r in reqs:
        e.submit(r)
    steps = 0
    while (step := e.begin_step()) is not None:
        clock.t = step.start + step.duration
        e.end_step(step)
        s = e.scheduler
        assert 0 <= s.used_tokens <= s.capacity
        assert s.free_tokens >= 0
        steps += 1
        if steps % 7 == 0 and rng.random() < 0.3:
            e.abort(rng.choice(reqs))
    s = e.scheduler
    assert all(r.finished for r in reqs)
    assert s.req_tokens == 0
    assert s.cache.protected_size == 0
    assert s.used_tokens == 0
