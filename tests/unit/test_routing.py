"""Routing policies: each one's defining behaviour, the prefix index, breaker and signals."""

import random

from kvfleet_gateway.breaker import Breaker
from kvfleet_gateway.routing import (
    POLICY_NAMES,
    Candidate,
    EngineSignals,
    RouteRequest,
    make_policy,
)
from kvfleet_gateway.routing.approx_tree import ApproxTree
from kvfleet_gateway.routing.blocks import text_blocks, token_blocks
from kvfleet_gateway.routing.kvfleet import KvfleetPolicy
from kvfleet_gateway.routing.prefix_index import PrefixIndex
from kvfleet_gateway.routing.random_choice import RandomChoice
from kvfleet_gateway.routing.sglang_cache_aware import SglangCacheAware
from kvfleet_gateway.signals import parse_metrics

RNG = random.Random(5)
SYSTEM = [RNG.randrange(100_000) for _ in range(2048)]


def request(system: list[int] = SYSTEM, question: int = 128, max_tokens: int = 256) -> RouteRequest:
    ids = system + [RNG.randrange(100_000) for _ in range(question)]
    return RouteRequest("m", ids, token_blocks(ids), len(ids), max_tokens)


def cands(
    n: int = 4, inflight: list[int] | None = None, engine: EngineSignals | None = None
) -> list[Candidate]:
    inflight = inflight or [0] * n
    return [Candidate(f"r{i}", inflight[i], 0, engine) for i in range(n)]


def test_blocks_identify_prefixes() -> None:
    a, b = text_blocks("x" * 1000 + "tail one"), text_blocks("x" * 1000 + "other end")
    assert a[:7] == b[:7]  # 7 full 128-character blocks of shared prefix
    assert text_blocks("y" + "x" * 999)[0] != a[0]
    ids = list(range(100))
    assert token_blocks(ids)[:3] == token_blocks([*ids[:96], 7, 7, 7, 7])[:3]


def test_prefix_index_matches_and_is_bounded_like_a_cache() -> None:
    idx = PrefixIndex()
    blocks = token_blocks(list(range(320)))  # 10 blocks
    idx.insert("a", blocks)
    idx.insert("b", blocks[:4])
    assert idx.match(blocks, ["a", "b", "c"]) == [10, 4, 0]
    idx.set_capacity("a", 6)  # trimming evicts the tail first: the head stays matchable
    assert idx.match(blocks, ["a"]) == [6]
    idx.remove("a")
    assert idx.match(blocks, ["a", "b"]) == [0, 4]
    assert idx.entries() == 4


def test_approx_tree_tracks_tenants_and_sizes() -> None:
    t = ApproxTree()
    t.insert("hello world", "a")
    t.insert("hello there", "b")
    assert t.prefix_match("hello world!") == (11, "a")
    assert t.prefix_match("hello th")[1] == "b"
    assert t.sizes == {"a": 11, "b": 11}
    t.remove_tenant("a")
    assert t.prefix_match("hello world")[1] == "b"


def test_sglang_cache_aware_follows_its_three_rules() -> None:
    p = SglangCacheAware()
    first = request()
    owner = p.choose(first, cands())
    assert p.choose(request(), cands()) == owner  # > 30% match: the owner
    other = request(system=[RNG.randrange(100_000) for _ in range(2048)])
    assert p.choose(other, cands()) != owner  # no match: the smallest tree, not the owner
    loads = [0, 0, 0, 0]
    loads[int(owner[1])] = 200  # imbalanced: max - min > 64 and max > 1.5 × min
    assert p.choose(request(), cands(inflight=loads)) != owner


def test_kvfleet_keeps_affinity_when_balanced() -> None:
    p = KvfleetPolicy()
    owner = p.choose(request(), cands())
    for _ in range(20):
        r = request()
        key = p.choose(r, cands())
        assert key == owner
        p.on_first_token(r, key)
        p.on_finished(r, key)


def test_kvfleet_spreads_a_hot_prefix_when_its_owner_is_saturated() -> None:
    p = KvfleetPolicy()
    owner = p.choose(request(), cands())
    seen = {owner}
    inflight = {f"r{i}": 0 for i in range(4)}
    inflight[owner] = 1
    for _ in range(200):  # a burst: nothing finishes, the owner's queue keeps growing
        key = p.choose(request(), [Candidate(k, n, 0, None) for k, n in inflight.items()])
        inflight[key] += 1
        seen.add(key)
    assert len(seen) >= 2
    assert max(inflight.values()) < 200 * 0.8  # no replica takes (nearly) everything


def test_kvfleet_avoids_a_replica_whose_kv_is_full() -> None:
    p = KvfleetPolicy()
    full = EngineSignals(0, 10, 0.999, 400_000, 0.0, 0.1)
    roomy = EngineSignals(0, 10, 0.2, 400_000, 0.0, 0.1)
    r = request()
    key = p.choose(r, [Candidate("full", 0, 0, full), Candidate("roomy", 0, 0, roomy)])
    assert key == "roomy"


def test_kvfleet_retry_replaces_the_placement() -> None:
    p = KvfleetPolicy()
    r = request()
    p.choose(r, cands(2))
    p.choose(r, cands(2))  # a retry elsewhere: pending counted once
    assert sum(p._pending_reqs.values()) == 1
    p.on_finished(r, "r0")
    assert sum(p._pending_reqs.values()) == 0


def test_every_policy_answers_for_any_candidate_set() -> None:
    for name in POLICY_NAMES:
        p = make_policy(name)
        for n in (1, 3):
            assert p.choose(request(), cands(n)) in {f"r{i}" for i in range(n)}
        p.on_removed("r0")


def test_random_spreads_evenly_and_a_seed_repeats_it() -> None:
    picks = [RandomChoice(seed=3).choose(request(), cands(4)) for _ in range(1)]
    p = RandomChoice(seed=3)
    seq = [p.choose(request(), cands(4)) for _ in range(4000)]
    counts = {k: seq.count(k) for k in {f"r{i}" for i in range(4)}}
    assert all(900 < n < 1100 for n in counts.values()), counts
    assert seq[0] == picks[0]  # the same seed, the same first pick


def test_breaker_opens_then_half_opens_and_closes() -> None:
    now = [0.0]
    b = Breaker(failure_threshold=3, cooldown_s=5.0, clock=lambda: now[0])
    for _ in range(3):
        assert b.allows()
        b.failure()
    assert b.state == "open" and not b.allows()
    now[0] = 5.1
    assert b.allows() and b.state == "half_open"
    b.attempt()
    assert not b.allows()  # one probe at a time
    b.failure()
    assert b.state == "open"
    now[0] = 10.3
    assert b.allows()
    b.attempt()
    b.success()
    assert b.state == "closed" and b.allows()


def test_metrics_parser_reads_both_name_styles_and_sums_ranks() -> None:
    text = (
        "# TYPE sglang:num_queue_reqs gauge\n"
        'sglang:num_queue_reqs{model_name="m",tp_rank="0"} 3.0\n'
        'sglang_num_queue_reqs{model_name="m",tp_rank="1"} 2.0\n'
        'sglang:num_running_reqs{model_name="m"} 7.0\n'
        'sglang:token_usage{tp_rank="0"} 0.4\nsglang:token_usage{tp_rank="1"} 0.6\n'
        'sglang:max_total_num_tokens{model_name="m"} 450000.0\n'
        "sglang:num_queue_reqs_created 1.0\n"
    )
    s = parse_metrics(text)
    assert s is not None
    assert (s.queue_reqs, s.running_reqs, s.max_total_tokens) == (5, 7, 450_000)
    assert abs(s.token_usage - 0.5) < 1e-9
    assert parse_metrics("up 1\n") is None
