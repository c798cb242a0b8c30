"""What one routing decision costs: each policy's `choose` with 32 candidates, on 2,176-token
prompts that share 2,048-token system prompts; the kvfleet policy with its approximate prefix
index full, and with an exact KV-event index of 500k pages per replica (what a fleet of 32
engines with large KV caches publishes), whose memory is measured too."""

from __future__ import annotations

import gc
import random
import resource
import time
from collections.abc import Callable
from typing import Any

from kvfleet_gateway.kv_events.hashing import page_hashes
from kvfleet_sim.fleet.routing import (
    Candidate,
    EngineSignals,
    EventIndex,
    KvfleetPolicy,
    Policy,
    RouteRequest,
    make_policy,
    token_blocks,
)

PAGE = 16
"""Tokens per page of the event index (the operator's default with prefixIndex: events)."""


def _percentiles(
    policy: Policy, prompts: list[RouteRequest], cands: list[Candidate], decisions: int
) -> tuple[float, float]:
    times = []
    for i in range(decisions):
        req = prompts[i % len(prompts)]
        t0 = time.perf_counter()
        key = policy.choose(req, cands)
        times.append(time.perf_counter() - t0)
        policy.on_first_token(req, key)
        policy.on_finished(req, key)
    times.sort()
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.99)] * 1e6


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def decision_time(
    replicas: int = 32,
    entries: int = 100_000,
    event_pages: int = 500_000,
    decisions: int = 5000,
    seed: int = 7,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    rng = random.Random(seed)
    systems = [[rng.randrange(128_000) for _ in range(2048)] for _ in range(64)]
    prompts: list[RouteRequest] = []
    events_prompts: list[RouteRequest] = []
    for _ in range(256):
        ids = rng.choice(systems) + [rng.randrange(128_000) for _ in range(128)]
        blocks = token_blocks(ids)
        prompts.append(RouteRequest("m", ids, blocks, len(ids), 256))
        pages = page_hashes(ids, PAGE)
        events_prompts.append(
            RouteRequest("m", ids, blocks, len(ids), 256, pages=pages, page_tokens=PAGE)
        )
    signals = EngineSignals(3, 40, 0.5, 450_000, 0.8, 0.5)
    cands = [
        Candidate(f"replica-{i}", rng.randrange(60), rng.randrange(100_000), signals)
        for i in range(replicas)
    ]
    out: dict[str, Any] = {}
    for name in ("round_robin", "sglang_cache_aware", "kvfleet"):
        policy = make_policy(name)
        if isinstance(policy, KvfleetPolicy):  # fill the prefix index to `entries` blocks
            while policy.index.entries() < entries:
                ids = [rng.randrange(128_000) for _ in range(2048)]
                policy.index.insert(rng.choice(cands).key, token_blocks(ids))
        out[f"{name}_p50_us"], out[f"{name}_p99_us"] = _percentiles(
            policy, prompts, cands, decisions
        )
    out["kvfleet_vs_round_robin_p99"] = out["kvfleet_p99_us"] / out["round_robin_p99_us"]

    # The exact index: every replica holds `event_pages` pages — the system prompts' pages
    # on a few replicas each, the rest distinct (the worst case for memory).
    gc.collect()
    before = _rss_bytes()
    index = EventIndex()
    for c in cands:
        index.set_live(c.key, PAGE)
    t0 = time.perf_counter()
    for system in systems:
        pages = page_hashes(system, PAGE)
        for c in rng.sample(cands, 3):
            index.stored(c.key, pages)
    getrandbits = rng.getrandbits
    for c in cands:
        missing = event_pages - index.pages_held(c.key)
        index.stored(c.key, [getrandbits(63) for _ in range(missing)])
    fill_s = time.perf_counter() - t0
    gc.collect()
    grown = _rss_bytes() - before
    distinct = index.distinct_pages()
    log(
        f"event index: {replicas} replicas × {event_pages:,} pages = {distinct:,} distinct "
        f"pages, {grown / 2**20:,.0f} MiB ({grown / distinct:.0f} B per page), filled in "
        f"{fill_s:.1f} s"
    )
    policy = make_policy("kvfleet", events=index)
    out["kvfleet_events_p50_us"], out["kvfleet_events_p99_us"] = _percentiles(
        policy, events_prompts, cands, decisions
    )
    t0 = time.perf_counter()
    index.cleared(cands[0].key)
    out["event_index_clear_s"] = time.perf_counter() - t0
    hash_times = []
    for req in events_prompts[:200]:
        ids = [int(i) for i in req.units]
        t1 = time.perf_counter()
        page_hashes(ids, PAGE)
        hash_times.append(time.perf_counter() - t1)
    hash_times.sort()
    out.update(
        event_pages_per_replica=event_pages,
        event_distinct_pages=distinct,
        event_index_mib=grown / 2**20,
        event_index_bytes_per_page=grown / distinct,
        event_index_mib_per_replica=grown / 2**20 / replicas,
        page_hash_p50_us=hash_times[len(hash_times) // 2] * 1e6,
    )
    return out
