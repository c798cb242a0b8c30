"""`kvfleet bench hostile-fields`' report: one table row per vector, its cells escaped; and
its place, the last section of `kvfleet bench reliability`'s report."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet_bench.hostile_fields import Vector, as_json, report


def test_the_report_is_one_row_per_vector_with_whether_it_held() -> None:
    vectors = [
        Vector("input_ids", "[-5, 10**12]", "400 (input_ids)", "status 400", True),
        Vector("churn", "a|b", "statuses [200, 429]", "3 loads charged", False),
    ]
    text = report(vectors, 12.34)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows == [
        "| vector | sent | answer | figure | held |",
        "| input_ids | [-5, 10**12] | 400 (input_ids) | status 400 | yes |",
        "| churn | a\\|b | statuses [200, 429] | 3 loads charged | **no** |",
    ]
    assert "1 of 2 held; run 12.3 s." in text
    assert as_json(vectors)["held"] is False
    assert as_json(vectors[:1]) == {
        "vectors": [{"name": "input_ids", "sent": "[-5, 10**12]", "answer": "400 (input_ids)",
                     "figure": "status 400", "held": True}],
        "held": True,
    }  # fmt: skip


def test_the_reliability_report_carries_the_hostile_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvfleet bench reliability` writes one report with three sections: the abusive
    requests over gateways and Redis, the hostile tenant, and issue 55's hostile fields and
    specs (once a sibling file that the reliability report did not mention). The runs are
    stood in for; what is checked is what lands in reliability.md."""
    from kvfleet_bench import hostile, hostile_fields, reliability

    run = reliability.Run(seed=0, requests=10, gateways=3, budget=60_000, statuses={},
                          by_kind={"honest": {"200": 10}}, billed=5, engine_tokens=5,
                          leases_left=0, reserved_left=0, server_errors=0,
                          last_refusal_after_restart_s=1.0, wall_s=2.0)  # fmt: skip
    attacker = {"spent": [429], "fresh": [400], "gzip": [415], "connections": 1,
                "connections_closed": 1}  # fmt: skip
    tenant = hostile.HostileRun(0, 1.0, 2.0, 1.5, 2.5, attacker)
    vector = Vector("pvc path out of its claim", "..", "refused at spec.model", "refused", True)

    async def once(seed: int, work: Path, requests: int) -> reliability.Run:
        return run

    async def hostile_run(seed: int, work: Path) -> hostile.HostileRun:
        return tenant

    monkeypatch.setattr(reliability, "run_once", once)
    monkeypatch.setattr(hostile, "run_hostile", hostile_run)
    monkeypatch.setattr(hostile_fields, "run_hostile_fields", lambda work, echo: [vector])
    reliability.run_reliability_bench(tmp_path / "out", tmp_path / "work", seeds=1, requests=10)
    text = (tmp_path / "out" / "reliability.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert [h.split(" (")[0] for h in headings] == [
        "# Reliability under abuse",
        "## A hostile tenant",
        "## Hostile fields and specs",
    ]
    assert "| pvc path out of its claim | .. | refused at spec.model | refused | yes |" in text
    assert "\n\n## Hostile fields and specs" in text and text.endswith("|\n")
