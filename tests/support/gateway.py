"""Gateway configs for tests, built from the same model the gateway parses."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvfleet_gateway.config import (
    DEFAULT_POLICY,
    Auth,
    Backends,
    CostConfig,
    Duration,
    GatewayConfig,
    Hold,
    KubernetesBackends,
    Limits,
    LimitsConfig,
    Listen,
    PrefillBackends,
    RedisOutage,
    Requests,
    Routing,
    Timeouts,
)
from kvfleet_gateway.limiter import budget_spec
from kvfleet_sim.procs import free_port


def gateway_config(
    static: list[str] | tuple[str, ...] = (),
    keys: Path | None = None,
    *,
    kubernetes: KubernetesBackends | None = None,
    store: str = "memory",
    defaults: Limits | None = None,
    gateway_replicas: int = 1,
    policy: str = DEFAULT_POLICY,
    health_interval: float = 0.2,
    scrape_interval: float = 1.0,
    cost: CostConfig | None = None,
    timeouts: Timeouts | None = None,
    max_body_bytes: int = GatewayConfig.max_body_bytes,
    hold: Hold | None = None,
    requests: Requests | None = None,
    prefill: PrefillBackends | None = None,
) -> GatewayConfig:
    """A gateway on 127.0.0.1 in front of `static` engines (or pods), with the keys file
    `keys` (None: no auth)."""
    return GatewayConfig(
        listen=Listen(host="127.0.0.1", metrics_port=free_port()),
        backends=Backends(static=tuple(static), kubernetes=kubernetes, prefill=prefill),
        routing=Routing(policy=policy, scrape_interval=Duration(scrape_interval)),
        auth=Auth(keys_file=str(keys) if keys else None, insecure_no_auth=keys is None),
        limits=LimitsConfig(
            store=store,
            defaults=defaults or Limits(),
            redis_outage=RedisOutage(gateway_replicas=gateway_replicas),
        ),
        health_interval=Duration(health_interval),
        cost=cost or CostConfig(),
        timeouts=timeouts or Timeouts(),
        max_body_bytes=max_body_bytes,
        hold=hold or Hold(),
        requests=requests or Requests(),
    )


def metrics_url(config: GatewayConfig) -> str:
    """Where a gateway started from `config` serves /metrics (its own port, not the API's)."""
    return f"http://{config.listen.host}:{config.listen.metrics_port}/metrics"


async def budget_in_use(store: Any, tenant: str, limits: Any, now: float | None = None) -> int:
    """Spent + reserved in the tenant's current budget period, as the store holds it."""
    spec = budget_spec(limits)
    assert spec is not None, "the tenant has no budget"
    state = await store.budget_state(tenant, spec, time.time() if now is None else now)
    return int(state.in_use)


async def upstream_errors(url: str) -> dict[str, float]:
    """`kvfleet_gateway_upstream_errors_total` from a gateway's /metrics URL, by its labels
    (`backend="…",kind="…"`)."""
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url) as r:
        text = await r.text()
    return {
        line.split("{", 1)[1].split("}", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvfleet_gateway_upstream_errors_total{")
    }
