"""Several gateways sharing one real Redis: no overspend under bursts, no leaked slots when
streams are cancelled, and the documented behaviour when Redis dies."""

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvfleet_gateway import inbound
from kvfleet_gateway.config import Duration, GatewayConfig, Limits
from kvfleet_gateway.keys import hash_key
from tests.support.gateway import gateway_config, metrics_url
from tests.support.metrics import scraped
from tests.support.waiting import until

from ..conftest import RedisProcess

KEY_BUDGET, KEY_RATED = "kvf-budgeted", "kvf-rated"


def keys(tmp_path: Path, budget: int, rated: bool = True) -> Path:
    """Tenant `budgeted` (a token budget) and, when `rated`, tenant `rated` (rates only)."""
    tenants: list[dict[str, Any]] = [
        {
            "name": "budgeted",
            "keys": [hash_key(KEY_BUDGET)],
            "limits": {"tokenBudget": {"tokens": budget, "period": "1d"}},
        }
    ]
    if rated:
        tenants.append(
            {
                "name": "rated",
                "keys": [hash_key(KEY_RATED)],
                "limits": {"requestsPerMinute": 20, "maxConcurrent": 8},
            }
        )
    f = tmp_path / "keys.yaml"
    f.write_text(json.dumps({"tenants": tenants}))
    return f


def gw_config(engines: list[str], keys_file: Path, store: str, **kw: Any) -> GatewayConfig:
    return gateway_config(engines, keys_file, store=store, health_interval=0.5, **kw)


def chat_body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "llama-3.1-8b",
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [{"role": "user", "content": "hello"}],
    }


async def chat(
    session: aiohttp.ClientSession, gw: str, key: str, max_tokens: int = 20, stream: bool = False
) -> tuple[int, Any]:
    async with session.post(
        f"{gw}/v1/chat/completions",
        json=chat_body(max_tokens, stream),
        headers={"Authorization": f"Bearer {key}"},
    ) as r:
        data = await r.read()
        return r.status, (json.loads(data) if not stream and data else data)


async def test_three_gateways_never_overspend_a_shared_budget(
    sim_server: Any, gateway_server: Any, redis_proc: RedisProcess, tmp_path: Path
) -> None:
    budget = 20_000
    engines = [await sim_server(time_scale=0.02, simulate_eos=False) for _ in range(2)]
    kf = keys(tmp_path, budget)
    gws = [
        await gateway_server(gw_config(engines, kf, redis_proc.url, gateway_replicas=3))
        for _ in range(3)
    ]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        results = await asyncio.gather(*(chat(s, gws[i % 3], KEY_BUDGET) for i in range(1000)))
    ok = [body for status, body in results if status == 200]
    refused = [body for status, body in results if status == 429]
    # 1,000 at once through one event loop (3 gateways, 2 engines, the clients) can delay a
    # Redis answer past the client's read timeout: those requests fail closed (503), which
    # never overspends. Every other answer is a 200 or a budget refusal.
    closed = [b for status, b in results if status == 503]
    assert all(b["error"]["code"] == "limits_unavailable" for b in closed)
    assert len(ok) + len(refused) + len(closed) == 1000
    assert all(b["error"]["code"] == "insufficient_quota" for b in refused)
    billed = sum(b["usage"]["total_tokens"] for b in ok)
    # The guarantee: reservations are atomic in Redis, and a reservation (prompt bound +
    # max_tokens) is never below what the engine bills for this prompt, so the engine's
    # own usage totals stay within the budget, however many gateways race.
    assert 0 < billed <= budget
    r = redis_proc.client()
    assert int(r.hget("kvf:{budgeted}:budget", str(int(time.time() // 86400)))) == billed
    assert int(r.get("kvf:{budgeted}:rtot") or 0) == 0
    assert r.zcard("kvf:{budgeted}:leases") == 0


async def test_the_budget_gauges_and_refusals_say_what_the_store_holds(
    sim_server: Any, gateway_server: Any, redis_proc: RedisProcess, tmp_path: Path
) -> None:
    """What `kvfleet usage` reads (the gateway's gauges) is Redis's state after settling, not
    the state at the last admission (which counted that request's reservation: it showed 50
    left where Redis held 154); a refusal names the request's bound and what remains."""
    budget = 400
    engines = [await sim_server(time_scale=0.02, simulate_eos=False)]
    config = gw_config(engines, keys(tmp_path, budget), redis_proc.url)
    gw = await gateway_server(config)
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{gw}/v1/chat/completions",
            json=chat_body(40, False),
            headers={"Authorization": f"Bearer {KEY_BUDGET}"},
        ) as resp:
            status, body = resp.status, await resp.json()
            # The period this request was billed to ends at the next midnight UTC.
            assert (
                int(resp.headers["x-kvfleet-budget-resets-at"])
                == (time.time() // 86400 + 1) * 86400
            )
        assert status == 200
        spent = body["usage"]["total_tokens"]
        status, refused = await chat(s, gw, KEY_BUDGET, max_tokens=250)  # fits 400, not 347
        async with s.get(metrics_url(config)) as r:
            metrics = await r.text()
    r = redis_proc.client()
    held = int(r.hget("kvf:{budgeted}:budget", str(int(time.time() // 86400))))
    assert held == spent
    assert f'kvfleet_gateway_budget_remaining_tokens{{tenant="budgeted"}} {budget - spent}.0' in (
        metrics
    ), metrics
    assert 'kvfleet_gateway_budget_reserved_tokens{tenant="budgeted"} 0.0' in metrics
    need = inbound.parse("chat", chat_body(250, False), Limits(), None).reserve_tokens
    assert status == 429
    assert refused["error"]["message"] == (
        f"token budget: this request may need up to {need:,} tokens (prompt + max_tokens); "
        f"{budget - spent:,} of {budget:,} remain this period ({spent:,} spent, 0 reserved by "
        "requests in flight)"
    )


async def test_a_budget_is_usable_to_its_last_requests(
    sim_server: Any, gateway_server: Any, redis_proc: RedisProcess, tmp_path: Path
) -> None:
    """Reservations are upper bounds (see inbound), so a burst of 1,000 at once admits only
    what the bounds fit; steady traffic — 8 clients, one request each at a time — uses the
    budget to within what 8 requests in flight reserve."""
    budget = 8_000
    engines = [await sim_server(time_scale=0.02, simulate_eos=False) for _ in range(2)]
    kf = keys(tmp_path, budget)
    gws = [
        await gateway_server(gw_config(engines, kf, redis_proc.url, gateway_replicas=2))
        for _ in range(2)
    ]
    billed: list[int] = []

    async def client(i: int, s: aiohttp.ClientSession) -> None:
        while True:
            status, body = await chat(s, gws[i % 2], KEY_BUDGET)
            if status != 200:
                assert body["error"]["code"] == "insufficient_quota"
                return
            billed.append(body["usage"]["total_tokens"])

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(client(i, s) for i in range(8)))
    reserve = inbound.parse("chat", chat_body(20, False), Limits(), None).reserve_tokens
    assert sum(billed) <= budget
    assert sum(billed) >= budget - 8 * reserve, (sum(billed), len(billed), reserve)


async def test_cancelled_streams_leave_no_leases_and_all_settle(
    sim_server: Any, gateway_server: Any, redis_proc: RedisProcess, tmp_path: Path
) -> None:
    engines = [await sim_server(time_scale=1.0, stream_interval=4) for _ in range(2)]
    kf = keys(tmp_path, 10**8)
    gws = [await gateway_server(gw_config(engines, kf, redis_proc.url)) for _ in range(3)]

    async def cancel_after_first_chunk(s: aiohttp.ClientSession, gw: str) -> None:
        body = {
            "model": "llama-3.1-8b",
            "max_tokens": 2000,
            "stream": True,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "a long story please"}],
        }
        async with s.post(
            f"{gw}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY_BUDGET}"},
        ) as r:
            assert r.status == 200
            await r.content.readuntil(b"\n\n")  # got a token: now hang up

    r = redis_proc.client()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(cancel_after_first_chunk(s, gws[i % 3]) for i in range(500)))
    for _ in range(100):
        if r.zcard("kvf:{budgeted}:leases") == 0 and int(r.get("kvf:{budgeted}:rtot") or 0) == 0:
            break
        await asyncio.sleep(0.1)
    assert r.zcard("kvf:{budgeted}:leases") == 0
    assert int(r.get("kvf:{budgeted}:rtot") or 0) == 0
    settled = list(r.scan_iter("kvf:{budgeted}:settled:*", count=1000))
    assert len(settled) == 500
    billed = int(r.hget("kvf:{budgeted}:budget", str(int(time.time() // 86400))))
    assert 0 < billed < 500 * 2000  # charged for what was served, not the whole reservation

    def cancelled() -> int:
        samples = (
            gateway_server.state(gw).metrics.requests.labels("budgeted", "llama-3.1-8b", "499")
            for gw in gws
        )
        return sum(int(sample._value.get()) for sample in samples)

    # Each handler records its 499 as it unwinds, after the settlement checked above: under
    # load that can trail the client's hang-up by a moment.
    for _ in range(100):
        if cancelled() == 500:
            break
        await asyncio.sleep(0.1)
    assert cancelled() == 500


async def test_redis_outage_budgets_fail_closed_rates_degrade(
    sim_server: Any, gateway_server: Any, redis_persistent: RedisProcess, tmp_path: Path
) -> None:
    redis_proc = redis_persistent
    engine = await sim_server(time_scale=0.05, simulate_eos=False)
    kf = keys(tmp_path, 10**6)
    gws = [
        await gateway_server(gw_config([engine], kf, redis_proc.url, gateway_replicas=2))
        for _ in range(2)
    ]
    async with aiohttp.ClientSession() as s:
        assert (await chat(s, gws[0], KEY_BUDGET))[0] == 200
        # A long stream admitted before the outage, finishing during it.
        slow = asyncio.create_task(chat(s, gws[0], KEY_BUDGET, max_tokens=400, stream=True))
        await asyncio.sleep(0.2)
        redis_proc.kill()
        status, body = await chat(s, gws[0], KEY_BUDGET)
        assert status == 503 and body["error"]["code"] == "limits_unavailable"
        # Rates degrade to 1/2 of 20 rpm per gateway: 10 pass on each, then 429 — never unlimited.
        statuses = [(await chat(s, gws[1], KEY_RATED))[0] for _ in range(12)]
        assert statuses[:10] == [200] * 10 and statuses[10:] == [429, 429]
        assert (await slow)[0] == 200
        async with s.get(f"{gws[0]}/healthz") as r:
            assert r.status == 200
        async with s.get(f"{gws[0]}/readyz") as r:  # it still serves the unbudgeted tenant
            assert r.status == 200 and await r.json() == {"ready": True}
        # Redis comes back with its data (AOF): every pooled connection died with it, yet
        # budgeted requests are served again within 5 s — on fresh connections, not 503s.
        redis_proc.start()
        back = time.monotonic()
        outcomes: list[tuple[float, int]] = []
        while (t := time.monotonic() - back) < 7:
            outcomes.append((t, (await chat(s, gws[len(outcomes) % 2], KEY_BUDGET))[0]))
            await asyncio.sleep(0.01)
        last_refusal = max((t for t, st in outcomes if st != 200), default=0.0)
        assert last_refusal < 5.0, f"a false 503 {last_refusal:.1f}s after Redis came back"
        assert outcomes[-1][1] == 200
        period = str(int(time.time() // 86400))
        for _ in range(50):
            used = int(redis_proc.client().hget("kvf:{budgeted}:budget", period) or 0)
            if used > 400:
                break
            await asyncio.sleep(0.2)
        assert used > 400  # includes the stream that ended while Redis was down


async def test_a_gateway_whose_every_tenant_is_budgeted_is_not_ready_without_redis(
    sim_server: Any, gateway_server: Any, redis_persistent: RedisProcess, tmp_path: Path
) -> None:
    """Budgets fail closed, so with every tenant budgeted a gateway that cannot reach Redis
    would answer each request 503: its readiness says so (and the InferenceService's Ready
    follows the gateway pods'), and comes back with Redis, with no request needed."""
    engine = await sim_server(time_scale=0.05, simulate_eos=False)
    kf = keys(tmp_path, 10**6, rated=False)
    config = gw_config([engine], kf, redis_persistent.url)
    gw = await gateway_server(config)

    async def ready() -> tuple[int, Any]:
        # The details are on the metrics port; the clients' port says only ready or not.
        detail = metrics_url(config).replace("/metrics", "/readyz")
        async with aiohttp.ClientSession() as s, s.get(f"{gw}/readyz") as r, s.get(detail) as d:
            assert r.status == d.status and await r.json() == {"ready": r.status == 200}
            return d.status, await d.json()

    assert await ready() == (200, {"ready": 1, "scaledToZero": False, "limitsStore": "ok"})
    redis_persistent.kill()
    status, body = await ready()
    assert status == 503 and body["limitsStore"] == "unreachable"
    redis_persistent.start()
    deadline = time.monotonic() + 10
    while (await ready())[0] != 200:
        assert time.monotonic() < deadline, "still not ready 10 s after Redis came back"
        await asyncio.sleep(0.2)


async def test_redis_restarted_empty_fails_budgets_closed_until_reset(
    sim_server: Any, gateway_server: Any, redis_proc: RedisProcess, tmp_path: Path
) -> None:
    """Without persistence a restart loses every spent budget: detected, never silent."""
    from kvfleet_gateway.redis_store import reset_lost_budgets

    engine = await sim_server(time_scale=0.02, simulate_eos=False)
    kf = keys(tmp_path, 10**6)
    gw = await gateway_server(gw_config([engine], kf, redis_proc.url))
    async with aiohttp.ClientSession() as s:
        assert (await chat(s, gw, KEY_BUDGET))[0] == 200
        redis_proc.kill()
        redis_proc.start()  # empty
        for _ in range(40):
            status, body = await chat(s, gw, KEY_BUDGET)
            if status != 503 or "lost" in body["error"]["message"]:
                break
            await asyncio.sleep(0.25)
        assert status == 503 and body["error"]["code"] == "limits_unavailable"
        assert (
            "lost" in body["error"]["message"]
            and "kvfleet budgets reset" in body["error"]["message"]
        )
        # A gateway started now has never seen the tenant: the tombstone tells it.
        fresh = await gateway_server(gw_config([engine], kf, redis_proc.url))
        assert (await chat(s, fresh, KEY_BUDGET))[0] == 503
        # Tenants without a budget are not affected.
        assert (await chat(s, gw, KEY_RATED))[0] == 200
        # The administrator accepts the loss: budgets are served again, counted from zero.
        assert await reset_lost_budgets(redis_proc.url) == ["budgeted"]
        assert (await chat(s, gw, KEY_BUDGET))[0] == 200
        assert (await chat(s, fresh, KEY_BUDGET))[0] == 200


async def test_settlements_redis_missed_survive_a_gateway_restart(
    sim_server: Any, gateway_server: Any, redis_persistent: RedisProcess, tmp_path: Path
) -> None:
    """A gateway that stops while Redis is down keeps what it could not settle in its
    journal; the next start writes it to Redis."""
    engine = await sim_server(time_scale=0.05, simulate_eos=False)
    kf = keys(tmp_path, 10**6)
    cfg = gw_config([engine], kf, redis_persistent.url)
    journal = tmp_path / "settlements.jsonl"
    limits = dataclasses.replace(cfg.limits, journal=str(journal), settle_grace=Duration(0.5))
    cfg = dataclasses.replace(cfg, limits=limits)
    gw = await gateway_server(cfg)
    period = str(int(time.time() // 86400))
    async with aiohttp.ClientSession() as s:
        # Long enough to be running when Redis goes (300 tokens could end before a fixed
        # sleep on an idle machine, settled in Redis and journaled nowhere).
        slow = asyncio.create_task(chat(s, gw, KEY_BUDGET, max_tokens=1500, stream=True))
        await until(lambda: scraped(f"{engine}/metrics", "sglang:num_running_reqs"), 10,
                    "the request running on the engine", interval=0.02)  # fmt: skip
        redis_persistent.kill()
        assert (await slow)[0] == 200  # finished while Redis was down: settled nowhere yet
    await gateway_server.stop(gw)
    lines = journal.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["used"] > 1500
    redis_persistent.start()
    before = int(redis_persistent.client().hget("kvf:{budgeted}:budget", period) or 0)
    await gateway_server(cfg)  # replays the journal at start
    for _ in range(50):
        after = int(redis_persistent.client().hget("kvf:{budgeted}:budget", period) or 0)
        if after > before:
            break
        await asyncio.sleep(0.2)
    assert after - before == json.loads(lines[0])["used"]
    assert not journal.exists()


async def test_two_services_sharing_a_redis_share_no_tenant_budget(redis_proc: Any) -> None:
    """Two InferenceServices' gateways on one Redis, each in its own scope (the operator's
    <namespace>/<name>): a tenant's spending in one leaves its budget in the other whole;
    gateways given the same scope share it."""
    import uuid

    from kvfleet_gateway.config import Limits, TokenBudget
    from kvfleet_gateway.limiter import Ticket
    from kvfleet_gateway.redis_store import RedisStore
    from kvfleet_kernel.schema import Duration

    limits = Limits(token_budget=TokenBudget(tokens=1_000, period=Duration(86_400)))
    stores = {
        scope: RedisStore(redis_proc.url, scope=scope)
        for scope in ("ai/llama", "ai/mistral", "ai/llama-again")
    }
    stores["ai/llama-again"].scope = "ai/llama"  # a second gateway of the first service

    async def spend(store: RedisStore, tokens: int) -> bool:
        now = time.time()
        ticket = Ticket("team-a", limits, tokens, uuid.uuid4().hex, now)
        decision = await store.admit(ticket)
        if decision.admitted:
            assert decision.lease is not None
            await store.settle(decision.lease, tokens, now)
        return decision.admitted

    try:
        assert await spend(stores["ai/llama"], 900)
        assert not await spend(stores["ai/llama-again"], 200)  # same scope: 100 left
        assert await spend(stores["ai/mistral"], 900)  # another scope: untouched
        r = redis_proc.client()
        assert int(r.hget("kvf:{ai/llama/team-a}:budget", str(int(time.time() // 86400)))) == 900
        assert not r.exists("kvf:{team-a}:budget")  # nothing unscoped
    finally:
        for store in stores.values():
            await store.client.aclose()


async def test_a_redis_with_a_password_is_reached_with_the_password_file(
    sim_server: Any, gateway_server: Any, tmp_path: Path
) -> None:
    """The Redis password comes from `limits.passwordFile` (a mounted Secret), never from the
    store URL a ConfigMap shows: with it budgets are kept in Redis; without it Redis refuses
    every command and budgeted requests fail closed (503), nothing is billed."""
    from ..conftest import redis_server

    rp = dataclasses.replace(redis_server(tmp_path), password="s3cret-for-tests")
    rp.start()
    try:
        engines = [await sim_server(time_scale=0.02, simulate_eos=False)]
        password = tmp_path / "redis-password"
        password.write_text("s3cret-for-tests\n")
        base = gw_config(engines, keys(tmp_path, 400), rp.url)
        config = dataclasses.replace(
            base, limits=dataclasses.replace(base.limits, password_file=str(password))
        )
        gw = await gateway_server(config)
        anonymous = await gateway_server(gw_config(engines, keys(tmp_path, 400), rp.url))
        async with aiohttp.ClientSession() as s:
            status, body = await chat(s, gw, KEY_BUDGET)
            assert status == 200, body
            status, refused = await chat(s, anonymous, KEY_BUDGET)
        assert status == 503, refused
        held = rp.client().hget("kvf:{budgeted}:budget", str(int(time.time() // 86400)))
        assert int(held or 0) == body["usage"]["total_tokens"]  # the anonymous one billed none
    finally:
        rp.stop()
