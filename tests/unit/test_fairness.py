"""The fair queue's order (VTC within strict priority classes) and the saturation test, pure."""

from __future__ import annotations

from kvfleet_gateway.fairness import FairQueue, Saturation, goes_now, room, saturated
from kvfleet_gateway.routing import Candidate, EngineSignals


def drain(q: FairQueue[str]) -> list[str]:
    out = []
    while (popped := q.pop()) is not None:
        out.append(popped[0])
    return out


def test_the_tenant_with_the_least_service_goes_next_and_idleness_banks_no_credit() -> None:
    q: FairQueue[str] = FairQueue(max_waiting=10)
    q.charge("a", 1.0, prompt_tokens=1000)  # a was served 1000, b nothing yet
    for i in range(3):
        assert q.push(f"a{i}", "a") == []
    assert q.push("b0", "b") == []
    # b starts waiting with its counter lifted to the least waiting (a's 1000): a tie, and
    # a's request waited longer.
    assert q.counters["b"] == 1000.0
    assert q.pop() == ("a0", "a")
    q.charge("a", 1.0, prompt_tokens=100)
    assert q.pop() == ("b0", "b")  # now b has less
    # Weights: a tenant of weight 2 is charged half per token.
    q.charge("b", 2.0, output_tokens=100)  # 2 × 100 / 2 = 100
    assert q.counters["b"] == 1100.0


def test_priority_classes_are_strict_and_a_full_queue_refuses() -> None:
    q: FairQueue[str] = FairQueue(max_waiting=3)
    assert q.push("s", "x", "sheddable") == q.push("n", "y") == q.push("c", "z", "critical") == []
    # Full: a standard request displaces the sheddable one; another is refused (a standard
    # tenant served no less waits ahead of it).
    assert q.push("n2", "y") == ["s"]
    assert q.push("over", "y") == ["over"]
    assert drain(q) == ["c", "n", "n2"]
    assert q.push("gone", "y") == [] and q.remove("gone") and len(q) == 0
    assert not q.remove("gone")


def test_a_full_queue_gives_up_the_newest_request_of_the_tenant_holding_most_of_it() -> None:
    q: FairQueue[str] = FairQueue(max_waiting=3)
    q.charge("flood", 1.0, prompt_tokens=10_000)
    assert [q.push(f"f{i}", "flood") for i in range(3)] == [[], [], []]
    assert q.push("s0", "steady") == ["f2"]  # the steady tenant had nothing waiting
    assert q.push("f3", "flood") == ["f3"]  # the flood cannot displace anyone
    # Lifted to the least waiting counter, the steady tenant ties the flood: the older goes.
    assert drain(q) == ["f0", "f1", "s0"]


def test_saturation_by_slots_or_by_every_engine_signal() -> None:
    def engine(queue: float, kv: float) -> EngineSignals:
        return EngineSignals(queue, 8.0, kv, 100_000, 0.0, 0.5)

    two = [Candidate("a", 0, 0, None), Candidate("b", 0, 0, None)]
    assert not saturated(7, two, Saturation(max_inflight_per_replica=4))
    assert saturated(8, two, Saturation(max_inflight_per_replica=4))
    assert not saturated(8, [], Saturation(max_inflight_per_replica=4))  # the hold's business
    busy = [Candidate("a", 0, 0, engine(5, 0.2)), Candidate("b", 0, 0, engine(0, 0.97))]
    assert saturated(0, busy, Saturation(queue_per_replica=4, kv_cache_usage=0.95))
    assert not saturated(0, busy, Saturation(queue_per_replica=4))  # b has room
    # Judged by signals alone, one request per replica with room goes out per look: the
    # signals lag what was just sent.
    assert room(0, busy, Saturation(queue_per_replica=4)) == 1
    assert room(3, two, Saturation(max_inflight_per_replica=4)) == 5
    assert not saturated(0, busy, Saturation())  # nothing judged


def test_only_a_tenant_under_its_share_takes_a_reserved_slot() -> None:
    q: FairQueue[str] = FairQueue(max_waiting=10)
    one = [Candidate("a", 0, 0, None)]
    s = Saturation(max_inflight_per_replica=4, reserve_per_replica=1)
    q.charge("flood", 1.0, prompt_tokens=5000)
    q.charge("steady", 1.0, prompt_tokens=100)
    assert goes_now(q, "flood", 2, one, s)  # room below the reserve
    assert not goes_now(q, "flood", 3, one, s)  # the last slot is reserved
    assert goes_now(q, "steady", 3, one, s)  # under its share: takes it
    assert not goes_now(q, "steady", 4, one, s)  # none left at all
    assert q.push("f", "flood") == [] and not q.under_share("flood")
    assert goes_now(q, "anyone", 0, [], s)  # no replica: the hold's business, not the queue's
