"""SGLang's scheduling behaviour in virtual time: batching, chunking, budgets, retraction."""

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.config import EngineConfig
from kvfleet_sim.engine import Engine, VirtualClock
from kvfleet_sim.request import Request
from kvfleet_sim.scheduler import InputTooLongError


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


# `make bench` runs this property with many more examples (KVFLEET_PROPERTY_EXAMPLES), drawn
# afresh each run; `make test` runs a fixed set (derandomized), so its time does not depend on
# the draw: one random draw (40 prompts of up to 20,000 tokens, 64-token chunks, lpm reordering
# the queue every step) once ran past the suite's 120 s timeout.
POOL_EXAMPLES = int(os.environ.get("KVFLEET_PROPERTY_EXAMPLES", "40"))
POOL_DERANDOMIZED = "KVFLEET_PROPERTY_EXAMPLES" not in os.environ


@st.composite
def pool_workloads(draw: st.DrawFn) -> tuple[dict[str, object], list[Request], list[int]]:
    """An engine shape and arrivals over it: pool, page and chunk sizes, a few long shared
    prefixes (up to the whole pool), prompts and outputs up to the pool's edge, and aborts."""
    capacity = draw(st.integers(300, 20_000))
    engine_kw: dict[str, object] = {
        "max_total_tokens": capacity,
        "page_size": draw(st.sampled_from([1, 16, 64])),
        "chunked_prefill_size": draw(st.sampled_from([64, 256, 2048, 8192])),
        "max_running_requests": draw(st.sampled_from([1, 4, 32])),
        "schedule_policy": draw(st.sampled_from(["fcfs", "lpm"])),
        "disable_radix_cache": draw(st.booleans()),
    }
    rng = random.Random(draw(st.integers(0, 2**32)))
    prefixes = [
        [rng.randrange(5000) for _ in range(rng.randrange(1, capacity))]
        for _ in range(draw(st.integers(1, 3)))
    ]
    reqs, t = [], 0.0
    for i in range(draw(st.integers(1, 40))):
        t += rng.expovariate(draw(st.sampled_from([2.0, 50.0, 1000.0])))
        shared = rng.choice(prefixes)[: rng.randrange(capacity)] if rng.random() < 0.7 else []
        prompt = shared + [rng.randrange(5000) for _ in range(rng.randrange(1, capacity))]
        # Outputs up to twice the pool (cut to fit at submit) on small pools, 1,500 at most.
        output = rng.randrange(0, min(2 * capacity, 1500))
        reqs.append(Request(f"r{i}", prompt, output, t, seed=i))
    aborts = draw(st.lists(st.integers(0, 39), max_size=4))
    return engine_kw, reqs, aborts


@settings(
    max_examples=POOL_EXAMPLES,
    deadline=None,
    derandomize=POOL_DERANDOMIZED,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(pool_workloads())
def test_the_kv_pool_is_never_over_committed_and_every_request_ends(
    case: tuple[dict[str, object], list[Request], list[int]],
) -> None:
    """Whatever the workload, the scheduler keeps its pool within capacity at every step and
    each request finishes or is aborted: it never raises (a long-prefix workload once crashed
    the fleet with "KV pool over-committed") and never stalls with work queued."""
    engine_kw, drawn, aborts = case
    e, clock = engine(**engine_kw)
    s = e.scheduler
    longest = e.layout.max_req_input_len  # the pool rounded to pages; longer is refused
    reqs = [Request(r.rid, r.prompt_ids[:longest], r.max_new_tokens, r.arrival_time, seed=r.seed)
            for r in drawn]  # fmt: skip
    # Every step computes at least one token: a prefill chunk or one per running request.
    most_steps = 4 * sum(r.prompt_len + r.max_new_tokens for r in reqs) + 1000
    pending, steps = list(reqs), 0
    while True:
        while pending and pending[0].arrival_time <= clock.t:
            e.submit(pending.pop(0))
        step = e.begin_step()
        if step is None:
            assert s.idle, "work queued but nothing scheduled"
            if not pending:
                break
            clock.t = pending[0].arrival_time
            continue
        clock.t = step.start + step.duration
        e.end_step(step)
        assert s.free_tokens >= 0 and 0 <= s.used_tokens <= s.capacity
        steps += 1
        if steps in aborts:
            e.abort(reqs[steps % len(reqs)])
        assert steps < most_steps, "no progress"
    assert all(r.finished for r in reqs)
    assert all(r.prompt_len + r.output_len < s.capacity for r in reqs)
    assert s.req_tokens == 0 and s.cache.protected_size == 0 and s.used_tokens == 0


def test_a_long_shared_prefix_workload_at_the_pool_edge_runs_to_the_end() -> None:
    """The reproduction of the crash: prompts of a ~6,000-token shared prefix plus a
    ~1,200-token question arriving faster than the engine serves them, on a pool that holds
    only a few of them. Locking a cached prefix during admission made it unevictable after
    the pool's room had been counted, and a page-sized tree keyed children by their first
    token: both over-committed the pool."""
    rng = random.Random(7)
    e, clock = engine(max_total_tokens=24_000, page_size=16, chunked_prefill_size=2048)
    systems = [[rng.randrange(5000) for _ in range(6000)] for _ in range(4)]

    def question(i: int) -> Request:
        prompt = rng.choice(systems) + [rng.randrange(5000) for _ in range(1200)]
        return Request(f"r{i}", prompt, 256, i * 0.02, seed=i)

    reqs = [question(i) for i in range(60)]
    for r in reqs:
        e.submit(r)
    s, fullest = e.scheduler, 0
    while (step := e.begin_step()) is not None:
        clock.t = step.start + step.duration
        e.end_step(step)
        fullest = max(fullest, s.capacity - s.free_tokens)
    assert all(r.finish_reason == "length" for r in reqs)
    assert fullest > 0.95 * s.capacity  # it ran at the pool's edge


def test_an_input_the_pool_cannot_hold_is_refused_and_outputs_are_cut_to_fit() -> None:
    e, _ = engine(max_total_tokens=1000)
    with pytest.raises(InputTooLongError, match="exceeds the maximum allowed length"):
        e.submit(req(0, 1000, 10))
    r = req(1, 900, 500)
    e.submit(r)
    assert r.max_new_tokens == 99  # input + output fit the pool (999 tokens)
