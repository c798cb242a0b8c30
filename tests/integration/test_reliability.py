"""A shortened `kvfleet bench reliability`: adversarial requests over 3 gateways sharing a
real Redis that is killed and restarted while they run."""

from pathlib import Path

from kvfleet_bench.reliability import run_once
from tests.conftest import require_binary


async def test_abuse_and_a_redis_restart_leave_the_budget_and_redis_clean(tmp_path: Path) -> None:
    require_binary("redis-server")
    run = await run_once(seed=1, work=tmp_path, requests=400, budget=60_000)
    assert run.billed <= run.budget  # the stated bound: billed never exceeds the budget
    assert run.billed <= run.engine_tokens  # and never more than the engines counted
    assert run.leases_left == 0 and run.reserved_left == 0
    assert run.server_errors == 0  # 4xx, served, or the documented 503 while Redis is down
    assert run.last_refusal_after_restart_s < 5.0
    assert run.by_kind["surrogate"] == {"400": run.by_kind["surrogate"].get("400", 0)}
    assert set(run.by_kind["deep_json"]) == {"400"}
    assert set(run.by_kind["wrong_key"]) == {"401"}
    assert "200" in run.by_kind["honest"]
