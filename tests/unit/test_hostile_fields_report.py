"""`kvfleet bench hostile-fields`' report: one table row per vector, its cells escaped."""

from __future__ import annotations

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
