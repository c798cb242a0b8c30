"""Tenant limits — rates, concurrency, token and cost budgets, models, priority — and where
the gateways keep them (`limits:`). `Limits` is also the model the CRD's
`spec.gateway.defaultLimits` and `tenants[].limits` are generated from."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

from kvfleet_gateway.fairness import PRIORITIES, Priority
from kvfleet_kernel.schema import Duration, Rule, fld

STORE_PATTERN = r"^(memory|rediss?://\S+|unix://\S+)$"
"""Where limits are kept: the gateway's `limits.store` and the CRD's `gateway.limitsStore`."""


@dataclass(frozen=True, kw_only=True)
class TokenBudget:
    tokens: int = fld(doc="Tokens (prompt + completion) a tenant may use per period.", minimum=1)
    period: Duration = fld(
        Duration(30 * 86400),
        "Budget period, e.g. 1h, 1d, 30d; budgets reset at multiples of it since the Unix epoch.",
    )


@dataclass(frozen=True, kw_only=True)
class CostBudget:
    amount: float = fld(
        doc="What a tenant may spend per period, at the models' prices (their currency).",
        minimum=0.01,
    )
    period: Duration = fld(
        Duration(30 * 86400),
        "Budget period, e.g. 1h, 1d, 30d; budgets reset at multiples of it since the Unix epoch.",
    )


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Per-tenant limits; an unset field is unlimited (or inherited when merged)."""

    RULES: ClassVar = (
        Rule(
            "!has(self.maxTokens) || !has(self.defaultMaxTokens)"
            " || self.defaultMaxTokens <= self.maxTokens",
            "defaultMaxTokens must not exceed maxTokens",
            ".defaultMaxTokens",
        ),
        Rule(
            "!has(self.tokenBudget) || !has(self.costBudget)",
            "set tokenBudget or costBudget, not both",
            ".costBudget",
        ),
    )
    requests_per_minute: int | None = fld(None, "Requests per minute.", minimum=1)
    tokens_per_minute: int | None = fld(
        None,
        "Tokens per minute: prompt + max_tokens reserved at admission, settled to the real"
        " usage when the response ends.",
        minimum=1,
    )
    max_concurrent: int | None = fld(None, "Requests in flight at once.", minimum=1)
    max_tokens: int | None = fld(
        None, "Cap on a request's max_tokens; a larger request is refused with 400.", minimum=1
    )
    default_max_tokens: int | None = fld(
        None,
        "max_tokens when a request sets none (else the cap, else the model's room).",
        minimum=1,
    )
    token_budget: TokenBudget | None = fld(None, "Tokens per period (the GPU-cost budget).")
    cost_budget: CostBudget | None = fld(
        None,
        "Cost per period at each model's price (models[].price): a 70B model's token costs"
        " what its price says, not what an 8B model's does.",
    )
    models: tuple[str, ...] | None = fld(
        None,
        "Models (served names, aliases or adapters) this tenant may use; a request for"
        " another is refused with 403 naming it. Unset: every model.",
        max_items=1000,
    )
    priority: Priority | None = fld(
        None,
        "Under overload (fairness on): critical goes before standard, standard before"
        " sheddable, and sheddable is refused rather than queued. Unset: standard.",
        enum=PRIORITIES,
    )
    fair_share_weight: float | None = fld(
        None,
        "Under overload, this tenant's share of the service relative to others (2: twice a"
        " tenant of weight 1). Unset: 1.",
        minimum=0.01,
        maximum=1000,
    )

    def merged(self, override: Limits | None) -> Limits:
        """`override`'s set fields win over ours."""
        if override is None:
            return self
        changes = {
            f.name: getattr(override, f.name)
            for f in fields(Limits)
            if getattr(override, f.name) is not None
        }
        # One budget at a time: an override's budget replaces ours, in tokens or in cost.
        if override.token_budget is not None:
            changes.setdefault("cost_budget", None)
        if override.cost_budget is not None:
            changes.setdefault("token_budget", None)
        return replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class TenantLimits:
    name: str = fld(doc="Tenant name (as in the API-key file).")
    limits: Limits = fld(doc="Overrides of the defaults for this tenant.")


# ---- where they are kept --------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RedisOutage:
    gateway_replicas: int = fld(
        1,
        "Gateway replicas: while Redis is down each enforces 1/N of every rate limit locally.",
        minimum=1,
    )


@dataclass(frozen=True, kw_only=True)
class LimitsConfig:
    store: str = fld(
        "memory",
        "`memory` (one gateway replica) or a redis:// URL shared by all replicas.",
        pattern=STORE_PATTERN,
    )
    password_file: str | None = fld(
        None,
        "A file holding the Redis password (AUTH) of a redis:// store, read at start; the"
        " operator mounts it from gateway.limitsStorePassword's Secret.",
    )
    scope: str = fld(
        "",
        "Whose tenants these are, in a shared Redis: gateways of one scope share tenants'"
        " budgets and limits, other scopes' keys are never read (the operator sets"
        " <namespace>/<InferenceService>). Empty: unscoped.",
        pattern=r"^[^{}\s]*$",
    )
    defaults: Limits = fld(Limits, "Limits of every tenant.")
    tenants: tuple[TenantLimits, ...] = fld((), "Per-tenant overrides.", max_items=1000)
    redis_outage: RedisOutage = fld(RedisOutage, "Behaviour while Redis is unreachable.")
    lease_ttl: Duration = fld(
        Duration(60),
        "Concurrency leases expire after this long without a heartbeat (a crashed gateway).",
    )
    settle_grace: Duration = fld(
        Duration(10),
        "At shutdown, how long settlements not yet written to Redis are retried before they"
        " go to the journal (or are reported lost).",
    )
    journal: str | None = fld(
        None,
        "File where settlements Redis could not take are kept across a gateway restart and"
        " replayed at start (an emptyDir survives container restarts).",
    )
