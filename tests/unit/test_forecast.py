"""Demand ahead (Holt's linear trend, scored errors, the warm pool's risk), the capacity the
fleet shows, the readers' arithmetic on gateway counters, and how `kvfleet describe` says it."""

from __future__ import annotations

import datetime
import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

import pytest

from kvfleet_cli.views import describe
from kvfleet_operator.scaling.forecast import (
    ALPHA,
    BETA,
    TREND_NOISE,
    Capacity,
    Forecast,
    learn_capacity,
    observe,
)
from kvfleet_operator.scaling.observe import parse_gateway, quantile
from kvfleet_sim.fleet.tracefile import TraceFileError, TraceFileWorkload, read_trace


def test_a_ramp_is_extrapolated_and_a_plateau_is_not() -> None:
    f = Forecast()
    for i in range(40):  # +2 req/s every 15 s tick
        f = observe(f, 10.0 + 2.0 * i, 15.0 * i, horizon_s=180.0)
    now = 10.0 + 2.0 * 39
    assert f.ahead(180.0) == pytest.approx(now + 2.0 / 15.0 * 180.0, rel=0.05)
    # The forecasts made a horizon ago are scored: a steady ramp is foreseen (small errors).
    assert f.errors and max(abs(e) for e in f.errors[-10:]) < 2.0
    flat = Forecast()
    for i in range(40):
        flat = observe(flat, 30.0, 15.0 * i, horizon_s=180.0)
    assert flat.ahead(180.0) == pytest.approx(30.0) and flat.risk() == pytest.approx(0.0)


def test_a_trend_that_did_not_come_true_is_believed_less() -> None:
    """A noisy plateau (its level moves every minute) gives Holt's method a trend that is
    noise: scored one horizon later it did not come true, and the forecast stops
    extrapolating it; a ramp's trend came true and is extrapolated whole."""
    plateau = Forecast()
    for i in range(240):  # an hour at 40 req/s, ±20% from one minute to the next
        level = 40.0 * random.Random(i // 4).uniform(0.8, 1.2)
        plateau = observe(plateau, level, 15.0 * i, horizon_s=195.0)
    assert plateau.trend_weight() < 0.1
    assert plateau.ahead(195.0) == pytest.approx(plateau.level, abs=0.1 * abs(plateau.trend) * 195)
    ramp = Forecast()
    for i in range(40):
        ramp = observe(ramp, 10.0 + 2.0 * i, 15.0 * i, horizon_s=195.0)
    assert ramp.trend_weight() > 0.9
    assert Forecast(level=5.0, trend=1.0).trend_weight() == 1.0  # nothing scored: believed


def poisson(rng: random.Random, mean: float) -> int:
    """A Poisson count: Knuth's method for small means, the normal approximation over 50."""
    if mean > 50:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k, p = k + 1, p * rng.random()
    return k


def test_the_trend_noise_factor_is_holts_trend_variance_on_white_noise() -> None:
    """`TREND_NOISE` is derived, not fitted: Holt's recursion fed white noise of unit
    variance at 15 s steps shows it (over 225) as its trend's variance."""
    rng, level, trend, seen = random.Random(7), 0.0, 0.0, []
    for _ in range(200_000):
        new_level = ALPHA * rng.gauss(0.0, 1.0) + (1 - ALPHA) * (level + trend * 15.0)
        trend = BETA * (new_level - level) / 15.0 + (1 - BETA) * trend
        level = new_level
        seen.append(trend)
    assert statistics.pvariance(seen[100:]) * 15.0**2 == pytest.approx(TREND_NOISE, rel=0.03)


def forecast_errors(base: float, slope: float, ticks: int) -> tuple[list[float], list[float]]:
    """Errors (forecast − truth, a cold start out) over 20 runs of Poisson arrivals counted
    every 15 s at `base` + `slope` × t req/s: the forecast as made, and with its whole trend."""
    made, whole = [], []
    for seed in range(20):
        rng, f = random.Random(seed), Forecast()
        for i in range(ticks):
            rate = poisson(rng, (base + slope * 15.0 * i) * 15.0) / 15.0
            f = observe(f, rate, 15.0 * i, horizon_s=195.0)
            if i >= 10:
                truth = base + slope * (15.0 * i + 195.0)
                made.append((f.ahead(195.0) or 0.0) - truth)
                whole.append((f.level or 0.0) + f.trend_weight() * f.trend * 195.0 - truth)
    return made, whole


def test_a_trend_of_counting_noise_is_not_extrapolated_a_busy_ramps_is() -> None:
    """Half a request to two a second over 15 minutes, counted every 15 s (a few dozen a
    tick): the counting noise moves Holt's trend as much as the ramp does, and extrapolated
    a cold start out it overshoots by a replica of a long-prompt model now and then (what a
    down window then holds for minutes). The trend's part over the noise is kept: the
    overshoots' 95th percentile is well under the whole trend's, the error no larger; a
    busy ramp (+3 req/s every tick) keeps nearly all its trend and is foreseen."""
    made, whole = forecast_errors(0.5, 0.0025, 60)
    p95 = int(0.95 * len(made))
    assert sorted(made)[p95] < 0.85 * sorted(whole)[p95]
    rms = [math.sqrt(statistics.fmean(e * e for e in errors)) for errors in (made, whole)]
    assert rms[0] <= rms[1]
    rng, ramp, gains = random.Random(1), Forecast(), []
    for i in range(40):
        ramp = observe(ramp, poisson(rng, (10.0 + 3.0 * i) * 15.0) / 15.0, 15.0 * i, 195.0)
        if i >= 10:
            gains.append(ramp.trend_gain())
    assert statistics.median(gains) > 0.9
    assert ramp.ahead(195.0) == pytest.approx(10.0 + 3.0 * (39 + 13), rel=0.1)


def test_the_risk_is_a_high_quantile_of_the_under_forecasts() -> None:
    f = Forecast(errors=(-5.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 40.0))
    assert f.risk() == 7.0  # nine in ten: one outlier does not size the pool
    assert Forecast(errors=(9.0, 9.0)).risk() == 0.0  # too few to say


def test_the_overshoot_is_the_same_quantile_of_the_over_forecasts() -> None:
    f = Forecast(errors=(5.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -40.0))
    assert f.overshoot() == 7.0  # how far under its forecast the rate came in, nine in ten
    assert f.risk() == 0.0  # the under-forecasts, one in ten here, are the other side
    assert f.noise() == 7.0  # the larger of the two: the falling-demand test's margin
    assert Forecast(errors=(-9.0, -9.0)).overshoot() == 0.0  # too few to say


def test_capacity_is_the_best_rate_served_well_capped_under_the_failures() -> None:
    c = Capacity()
    assert c.per_replica is None
    for rate in (10.0, 20.0, 30.0):  # two replicas kept up at 5, 10, 15 req/s each
        c = learn_capacity(c, rate, 2, kept_up=True)
    assert c.per_replica == pytest.approx(15.0 * 1.15)  # explores past the best served
    c = learn_capacity(c, 36.0, 2, kept_up=False)  # fell behind at 18 per replica
    assert c.per_replica == pytest.approx(0.9 * 18.0)
    assert learn_capacity(c, 0.01, 2, kept_up=True) == c  # an idle fleet says nothing
    assert learn_capacity(c, 40.0, 2, kept_up=None).per_replica == c.per_replica  # no evidence
    # Only failures (an overloaded start): no estimate yet, the reactive terms decide.
    overloaded = learn_capacity(learn_capacity(Capacity(), 8.0, 1, False), 6.0, 1, False)
    assert overloaded.per_replica is None


def test_the_gateways_roofline_is_where_the_plan_starts_and_failures_cap_it() -> None:
    c = learn_capacity(Capacity(), None, 2, None, ceiling=12.0)  # no rate yet, a roofline
    assert c.per_replica == 12.0  # a plan before any tick was judged
    for rate in (10.0, 20.0):  # kept up at 5 and 10 per replica: under the roofline
        c = learn_capacity(c, rate, 2, kept_up=True)
    assert c.per_replica == 12.0  # a generous fleet's history does not pull the plan down
    c = learn_capacity(c, 24.0, 2, kept_up=True, ceiling=None)  # None: the last roofline holds
    assert c.ceiling == 12.0 and c.per_replica == pytest.approx(12.0 * 1.15)  # served past it
    c = learn_capacity(c, 30.0, 2, kept_up=False, ceiling=20.0)  # fell behind at 15
    c = learn_capacity(c, 32.0, 2, kept_up=False)
    assert c.per_replica == pytest.approx(0.9 * 15.0)  # the failures have the last word


def test_the_capacity_boundary_outvotes_a_burst_and_a_lucky_tick() -> None:
    """The cut with the fewest ticks on its wrong side: one queue at a low rate (a burst
    inside a tick) does not pull the plan down to it, nor one lucky tick at a high rate up."""
    c = Capacity()
    for per in (4.0, 5.0, 6.0, 7.0, 8.0, 9.0):
        c = learn_capacity(c, per, 1, kept_up=True)
    c = learn_capacity(c, 3.0, 1, kept_up=False)  # a burst queued at 3/replica
    for per in (10.0, 11.0, 12.0):
        c = learn_capacity(c, per, 1, kept_up=False)
    c = learn_capacity(c, 15.0, 1, kept_up=True)  # one lucky tick
    assert c.per_replica == pytest.approx(0.9 * 10.0)  # under the first failure past 9


def test_gateway_counters_give_arrivals_and_latency_quantiles() -> None:
    text = "\n".join([
        "# TYPE kvfleet_gateway_requests counter",
        'kvfleet_gateway_requests_total{tenant="a",model="m",status="200"} 90',
        'kvfleet_gateway_requests_total{tenant="b",model="m",status="429"} 10',
        "# TYPE kvfleet_gateway_inflight_requests gauge",
        'kvfleet_gateway_inflight_requests{tenant="a",model="m"} 5',
        "# TYPE kvfleet_gateway_time_to_first_token_seconds histogram",
        'kvfleet_gateway_time_to_first_token_seconds_bucket{tenant="a",model="m",le="0.5"} 50',
        'kvfleet_gateway_time_to_first_token_seconds_bucket{tenant="a",model="m",le="1.0"} 90',
        'kvfleet_gateway_time_to_first_token_seconds_bucket{tenant="a",model="m",le="+Inf"} 100',
        'kvfleet_gateway_time_to_first_token_seconds_count{tenant="a",model="m"} 100',
        'kvfleet_gateway_time_to_first_token_seconds_sum{tenant="a",model="m"} 60',
        "# TYPE kvfleet_gateway_held_requests gauge",
        'kvfleet_gateway_held_requests{model="m"} 2',
        "# TYPE kvfleet_gateway_queued_requests gauge",
        'kvfleet_gateway_queued_requests{model="m"} 5',
        "# TYPE kvfleet_gateway_inter_token_latency_seconds histogram",
        'kvfleet_gateway_inter_token_latency_seconds_bucket{tenant="a",model="m",le="0.02"} 900',
        'kvfleet_gateway_inter_token_latency_seconds_bucket{tenant="a",model="m",le="0.04"} 990',
        'kvfleet_gateway_inter_token_latency_seconds_bucket{tenant="a",model="m",le="+Inf"} 1000',
        "# TYPE kvfleet_gateway_replica_throughput_requests_per_second gauge",
        'kvfleet_gateway_replica_throughput_requests_per_second{model="m"} 12.5',
        "",
    ])  # fmt: skip
    totals = parse_gateway(text) + parse_gateway(text)  # two gateway pods
    assert totals.arrivals == 2 * 105
    assert totals.held == 2 * (2 + 5)  # held for a replica, or queued under overload: waiting
    buckets = dict(totals.ttft)
    assert buckets[1.0] == 180 and buckets[float("inf")] == 200
    assert quantile(buckets, 0.5) == pytest.approx(0.5)
    assert quantile(buckets, 0.7) == pytest.approx(0.75)  # interpolated in (0.5, 1.0]
    assert quantile(buckets, 0.99) == pytest.approx(1.0)  # the +Inf bucket: its lower bound
    assert quantile({}, 0.99) is None
    itl = dict(totals.itl)  # the inter-token latency's histogram, summed apart from TTFT's
    assert itl == {0.02: 1800, 0.04: 1980, float("inf"): 2000}
    assert quantile(itl, 0.99) == pytest.approx(0.04)
    assert totals.throughput == (12.5, 12.5)  # each gateway's roofline, averaged by the reader


def test_mooncake_hash_ids_replay_as_shared_prefixes(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 1100, "output_length": 10, "hash_ids": [7, 8, 9]},
        {"timestamp": 2500, "input_length": 1200, "output_length": 0, "hash_ids": [7, 8, 11]},
        {"timestamp": 2000, "input_length": 300, "output_length": 5, "hash_ids": [12]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    read = read_trace(trace)
    assert [r.time for r in read] == [0.0, 1.0, 1.5]  # ms, from the first, time-ordered
    assert read[2].output_tokens == 1 and read[0].hash_ids == (7, 8, 9)
    a, _, b = list(TraceFileWorkload(read, 128_256))
    assert len(a.prompt_ids) == 1100 and len(b.prompt_ids) == 1200
    assert a.prompt_ids[:1024] == b.prompt_ids[:1024]  # blocks 7 and 8: the same tokens
    assert a.prompt_ids[1024:1100] != b.prompt_ids[1024:1100]
    trace.write_text('{"timestamp": 1, "input_length": 5}\n')
    with pytest.raises(TraceFileError, match=r"t.jsonl:1: KeyError"):
        read_trace(trace)


def test_describe_says_what_bound_the_decision_and_the_demand() -> None:
    now = datetime.datetime(2026, 12, 2, tzinfo=datetime.UTC)
    body = {
        "metadata": {"name": "llama", "namespace": "ai"},
        "spec": {"model": {"name": "llama-3.1-8b"}, "autoscaling": {"maxReplicas": 8}},
        "status": {
            "autoscaling": {
                "desiredActive": 4, "desiredWarm": 2, "reason": "scale up to 4: forecast",
                "source": "prometheus", "boundBy": "forecast",
                "forecastRequestsPerSecond": 80.5, "capacityRequestsPerSecond": 21.3,
                "forecastTrendWeight": 0.25, "replicaThroughputRequestsPerSecond": 30.5,
            },
        },
    }  # fmt: skip
    text = describe(body, [], [], [], now)
    assert "bound by forecast" in text
    assert (
        "demand: forecast 80.5 req/s one cold start ahead (25% of the trend extrapolated),"
        " capacity 21.3 req/s per replica (a replica completes at most 30.5 at the mix)" in text
    )


def test_describe_shows_a_missing_warm_spare_and_why() -> None:
    """3 active of maxReplicas 3 leaves no room for the spare (warm replicas count inside
    maxReplicas): describe said `desired 3/0` and no more."""
    now = datetime.datetime(2026, 12, 2, tzinfo=datetime.UTC)
    scaling = {"minReplicas": 1, "maxReplicas": 3, "warmReplicas": 1}

    def body(active: int, warm: int, reason: str = "scale up") -> dict[str, Any]:
        decision = {"desiredActive": active, "desiredWarm": warm, "reason": reason}
        return {"metadata": {"name": "llama", "namespace": "ai"},
                "spec": {"model": {"name": "llama-3.1-8b"}, "autoscaling": scaling},
                "status": {"autoscaling": decision}}  # fmt: skip

    text = describe(body(3, 0), [], [], [], now)
    assert "Autoscaling:  1 active at least, 3 replicas at most (active + warm), 1 warm" in text
    assert (
        "Warm spares: 0 of 1: at maxReplicas (3 active of 3; warm replicas count inside it)" in text
    )
    assert "Warm spares: 1 of 1\n" in describe(body(2, 1), [], [], [], now)
    falling = body(1, 0, "scale down; 0 warm under the floor of 1 while demand falls")
    assert "Warm spares: 0 of 1: demand falls clearly" in describe(falling, [], [], [], now)


def test_the_forecast_acts_only_when_backed_as_the_readme_says() -> None:
    """The README: the forecast orders replicas ahead of demand only when its capacity rests
    on a limit (a gateway's roofline, exported once `MIN_MIX_SAMPLES` requests finished there,
    or a rate the fleet fell behind at) and the arrival rate already uses half
    (`FORECAST_BACKING`) of the active replicas' capacity."""
    from kvfleet_gateway.routing.kvfleet import MIN_MIX_SAMPLES
    from kvfleet_operator.scaling.policy import FORECAST_BACKING

    one_tick = learn_capacity(Capacity(), 0.2, 1, kept_up=True)
    assert one_tick.per_replica == pytest.approx(0.2 * 1.15)
    assert not one_tick.bounded  # a rate served is a floor, not a limit: it backs no forecast
    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    assert f"once {MIN_MIX_SAMPLES} requests have finished there" in readme
    assert FORECAST_BACKING == 0.5
    assert "already uses half of the active replicas' capacity" in readme
