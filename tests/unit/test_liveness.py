"""The operator's liveness judgement: stuck work fails the probe, failing-fast work and an
idle operator do not."""

from __future__ import annotations

from kvfleet_operator.liveness import Progress, stalled


def progress(**kw: object) -> Progress:
    base: dict[str, object] = {
        "now": 1000.0,
        "worker_pending": False,
        "worker_ok_at": 0.0,
        "autoscaling": False,
        "tick_done_at": 0.0,
    }
    return Progress(**{**base, **kw})  # type: ignore[arg-type]


def test_an_idle_operator_is_alive_however_long_ago_its_last_reconcile() -> None:
    assert stalled(progress(), 300) is None


def test_pending_work_without_success_for_the_limit_is_stalled() -> None:
    assert stalled(progress(worker_pending=True, worker_ok_at=800.0), 300) is None
    reason = stalled(progress(worker_pending=True, worker_ok_at=600.0), 300)
    assert reason is not None and "no reconcile has succeeded for 400 s" in reason


def test_an_autoscaler_whose_ticks_stopped_is_stalled_only_when_something_is_autoscaled() -> None:
    assert stalled(progress(tick_done_at=0.0), 300) is None
    reason = stalled(progress(autoscaling=True, tick_done_at=100.0), 300)
    assert reason is not None and "autoscaler tick" in reason
    assert stalled(progress(autoscaling=True, tick_done_at=900.0), 300) is None
