"""A trickle buys no GPUs, a fleet that falls behind still grows: the pure policy over
scripted ticks and over generated ones (hypothesis). The first case is issue 54's: three
20-token requests to a minimum of two, which the forecast divided by a capacity learned from
those three requests alone turned into `scale up to 4: forecast 0.4 req/s in 255s at
0.1/replica`."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_operator.scaling.forecast import Capacity, CapacitySample, learn_capacity
from kvfleet_operator.scaling.model import Fleet, ReplicaSignals, ScalingConfig, Signals, State
from kvfleet_operator.scaling.policy import decide, forecast_backed

TICK = 15.0
# The example service (examples/llama-3.1-8b-h100-autoscaling.yaml): 2..8, one warm spare
# sized by the forecast's risk too, a cold start of 240 s, TTFT p99 within 2 s.
EXAMPLE = ScalingConfig(
    min_replicas=2,
    max_replicas=8,
    warm_replicas=1,
    warm_auto=True,
    target_queue_depth=4,
    cold_start_s=240,
    slo_ttft_s=2.0,
)


def tick_signals(
    active: int,
    rate: float,
    queue: float = 0.0,
    running: float = 0.0,
    kv: float = 0.0,
    ttft: float | None = None,
    roofline: float | None = None,
) -> Signals:
    replicas = tuple(
        ReplicaSignals(f"p{i}", queue / active, running / active, kv) for i in range(active)
    )
    return Signals(replicas, arrival_rate=rate, ttft=ttft, replica_throughput=roofline)


def run(ticks: list[Signals], active: int = 2, config: ScalingConfig = EXAMPLE) -> list[int]:
    """The sizes the policy decides tick by tick, the fleet following at once."""
    state, sizes = State(desired_active=active), []
    for i, sig in enumerate(ticks):
        d, state = decide(config, state, Fleet(active, config.warm_replicas, 0), sig, i * TICK)
        sizes.append(d.desired_active + d.desired_warm)
        active = d.desired_active
    return sizes


def test_three_small_requests_in_one_tick_leave_the_minimum() -> None:
    # The three requests land in one 15 s tick (0.2 req/s), each done within the tick.
    ticks = [tick_signals(2, 0.0), tick_signals(2, 0.2, ttft=0.05)]
    ticks += [tick_signals(2, 0.0) for _ in range(24)]
    assert set(run(ticks)) == {3}  # two active and the one warm spare, throughout


def test_a_slow_request_on_an_idle_fleet_adds_no_replica() -> None:
    # One request's TTFT over the objective (its p99 is the only one there is) with nothing
    # queued or running: more replicas would shorten nobody's wait.
    ticks = [tick_signals(2, 0.0), tick_signals(2, 0.2, ttft=2.45)]
    ticks += [tick_signals(2, 0.0, ttft=2.45) for _ in range(4)]
    assert set(run(ticks)) == {3}


def test_capacity_never_under_what_a_replica_served_while_keeping_up() -> None:
    c = Capacity()
    for rate, ok in [(10.0, True), (12.0, True), (11.0, False), (30.0, False)]:
        c = learn_capacity(c, rate, 1, ok)
    assert c.per_replica is not None and c.per_replica >= 12.0
    # And the roofline (the model, GPU and engine limits the gateways know) is where a plan
    # starts: a limit, which a floor of served rates is not.
    assert not Capacity((CapacitySample(0.1, True),)).bounded
    assert Capacity((CapacitySample(0.1, True),), ceiling=25.0).bounded


@settings(max_examples=60, deadline=None)
@given(
    rates=st.lists(st.floats(0.0, 5.0), min_size=4, max_size=40),
    roofline=st.one_of(st.none(), st.floats(20.0, 60.0)),
    ttft=st.one_of(st.none(), st.floats(0.0, 10.0)),
)
def test_a_light_load_without_pressure_never_scales_up(
    rates: list[float], roofline: float | None, ttft: float | None
) -> None:
    """Whatever its shape, a load of at most 5 req/s on two replicas a roofline rates at 20+
    each (or with no roofline at all), that leaves no queue, KV usage low and at most one
    request running at a tick, keeps the minimum — whatever the forecast extrapolates and
    whatever TTFT quantile so few requests show."""
    ticks = [tick_signals(2, r, running=min(1.0, r), kv=0.02, ttft=ttft, roofline=roofline)
             for r in rates]  # fmt: skip
    sizes = run(ticks, config=ScalingConfig(**{**EXAMPLE.__dict__, "warm_auto": False}))
    assert set(sizes) == {3}


@settings(max_examples=30, deadline=None)
@given(per=st.floats(1.0, 20.0), overload=st.floats(1.5, 4.0))
def test_a_fleet_that_falls_behind_grows(per: float, overload: float) -> None:
    """Arrivals past what two replicas serve (`per` each): the queue grows tick by tick and
    the fleet grows — scaling needs evidence, and this is evidence."""
    state, active, grew = State(desired_active=2), 2, False
    queue = 0.0
    for i in range(12):
        rate = overload * 2 * per
        queue = max(0.0, queue + (rate - active * per) * TICK)
        sig = tick_signals(active, rate, queue=queue, running=8 * active, kv=0.6, ttft=3.0)
        d, state = decide(EXAMPLE, state, Fleet(active, 1, 0), sig, i * TICK)
        grew = grew or d.desired_active > 2
        active = d.desired_active
    assert grew


def test_a_ramp_that_loads_the_fleet_is_forecast_ahead() -> None:
    """The forecast still orders ahead of a ramp once the observed load is real: a rate
    climbing past half of the fleet's roofline capacity, with no queue yet, scales up
    before any queue forms (pre-warming backed by load)."""
    sizes: list[int] = []
    state, active = State(desired_active=2), 2
    for i in range(20):
        rate = 2.0 * i  # +2 req/s a tick against replicas of 20 req/s each
        sig = tick_signals(active, rate, running=active, kv=0.3, ttft=0.2, roofline=20.0)
        d, state = decide(EXAMPLE, state, Fleet(active, 1, 0), sig, i * TICK)
        sizes.append(d.desired_active)
        active = d.desired_active
    first_up = next(i for i, n in enumerate(sizes) if n > 2)
    assert 2.0 * first_up < 2 * 20.0  # ordered before the rate reached two replicas' capacity
    assert forecast_backed(state, 2)
