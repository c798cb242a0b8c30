"""When the operator is stuck: the judgement behind its liveness probe, as a pure function.

kopf's liveness endpoint answers 500 when a probe handler raises; `handlers.py` raises with
`stalled`'s reason. Stuck means work that does not move, not work that fails fast: a
reconcile worker with keys waiting (queued, running or backing off) and no success for
`stall_s`, or an autoscaler whose tick has not completed for `stall_s` (a tick that fails
completes: Prometheus being down is not the operator being stuck). A restart is the remedy
for a wedged connection pool or a deadlocked thread, not for an API server that refuses.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    now: float
    worker_pending: bool
    """Keys queued, a reconcile running, or failures waiting for their retry."""
    worker_ok_at: float
    """When the worker last succeeded or was idle with nothing pending (monotonic seconds)."""
    autoscaling: bool
    """Whether any service is autoscaled (else the autoscaler's ticks are not judged)."""
    tick_done_at: float
    """When the autoscaler last finished a tick (or started)."""


def stalled(p: Progress, stall_s: float) -> str | None:
    """Why the operator should be restarted, or None while it makes progress."""
    if p.worker_pending and p.now - p.worker_ok_at > stall_s:
        return (
            f"no reconcile has succeeded for {p.now - p.worker_ok_at:.0f} s with work pending"
            f" (limit {stall_s:g} s)"
        )
    if p.autoscaling and p.now - p.tick_done_at > stall_s:
        return (
            f"no autoscaler tick has completed for {p.now - p.tick_done_at:.0f} s"
            f" (limit {stall_s:g} s)"
        )
    return None
