"""The routing tuning report: its grid of `missWeight` brackets the weight it picks."""

from __future__ import annotations

from pathlib import Path

from kvfleet_bench.routing_tuning import WEIGHTS, bracket_note


def test_the_miss_weight_grid_says_whether_it_brackets_its_best() -> None:
    """The tuning report's grid must bracket the weight it picks (8 was its old grid's edge)."""
    assert bracket_note(WEIGHTS, 8.0).startswith("inside the grid (0–32)")
    assert bracket_note((0.0, 1.0, 2.0, 4.0, 8.0), 8.0).startswith("at the grid's edge")


def test_a_routing_run_of_the_lora_cell_alone_draws_no_empty_plot(tmp_path: Path) -> None:
    """`kvfleet bench routing --workloads lora` crashed drawing a plot of zero workloads."""
    from kvfleet_bench.routing import plot

    plot([], tmp_path / "routing.png")
    assert not (tmp_path / "routing.png").exists()
