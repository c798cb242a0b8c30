"""The gateway's configuration: one YAML/JSON document, the contract the operator renders.

Declared once, here, in the same schema language as the InferenceService spec
(`kvfleet_kernel.schema`): each setting has one type, one default and one description, from
which come the parser (errors name the field path, e.g. `limits.tenants[1].limits.maxTokens`),
`to_dict` (the operator's ConfigMap round-trips through it), the CLI's defaults, and the
reference in `docs/`. The tenant `Limits` are the very model the CRD's
`spec.gateway.defaultLimits` is generated from.

    listen: {host: 0.0.0.0, port: 8080}
    models: [{name: llama-3.1-8b, contextLength: 131072}]     # empty: learn from backends
    backends:
      static: [http://10.0.0.1:30000]                        # or
      kubernetes: {namespace: ai, selector: "app=x", port: 30000}
    routing: {policy: kvfleet, scrapeInterval: 1s, tuning: {prefillTokensPerSecond: 30000}}
    auth: {keysFile: /etc/kvfleet/keys/keys.yaml}
    limits:
      store: memory                                          # or redis://host:6379/0
      defaults: {requestsPerMinute: 600, tokensPerMinute: 200000, maxConcurrent: 16,
                 maxTokens: 4096, defaultMaxTokens: 512,
                 tokenBudget: {tokens: 10000000, period: 30d}}
      tenants: [{name: team-a, limits: {maxConcurrent: 64}}]
      redisOutage: {gatewayReplicas: 2}
    cost: {gpuHourlyPrice: 4.0, gpusPerReplica: 1}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from kvfleet_gateway.allowlist import Governed
from kvfleet_gateway.config.fairness import Fairness
from kvfleet_gateway.config.keys import (
    KeysFile,
    KeysFileTenant,
    parse_keys_file,
    tenant_problems,
)
from kvfleet_gateway.config.limits import (
    STORE_PATTERN,
    CostBudget,
    Limits,
    LimitsConfig,
    RedisOutage,
    TenantLimits,
    TokenBudget,
)
from kvfleet_gateway.config.lora import ADAPTER_NAME_PATTERN, AdapterSource, Lora
from kvfleet_gateway.config.pools import PoolConfig, check_unique, parse_pools
from kvfleet_gateway.config.serving import (
    Backends,
    CostConfig,
    KubernetesBackends,
    ModelConfig,
    PrefillBackends,
    PrefillEngine,
    PrefixIndexConfig,
    Price,
    Routing,
)
from kvfleet_gateway.routing import DEFAULT_POLICY, POLICY_NAMES
from kvfleet_kernel.schema import ConfigError, Duration, Rule, fld, parse, to_json, yaml_position

__all__ = [
    "ADAPTER_NAME_PATTERN",
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "STORE_PATTERN",
    "AdapterSource",
    "Auth",
    "Backends",
    "CacheGroup",
    "CacheIsolation",
    "ConfigError",
    "Connections",
    "CostBudget",
    "CostConfig",
    "Duration",
    "Fairness",
    "GatewayConfig",
    "Hold",
    "KeysFile",
    "KeysFileTenant",
    "KubernetesBackends",
    "Limits",
    "LimitsConfig",
    "Listen",
    "Lora",
    "ModelConfig",
    "PoolConfig",
    "PrefillBackends",
    "PrefillEngine",
    "PrefixIndexConfig",
    "Price",
    "RedisOutage",
    "Requests",
    "Routing",
    "TenantLimits",
    "Timeouts",
    "TokenBudget",
    "WorkBounds",
    "load_config",
    "parse_keys_file",
    "parse_pools",
    "tenant_problems",
]


# ---- the gateway document -------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Connections:
    """What a client connection may hold of the gateway before it has sent a request: an
    idle or trickling connection costs a file descriptor and memory, and a key is not needed
    to open one."""

    keepalive_timeout: Duration = fld(
        Duration(75), "An idle keep-alive connection is closed after this (as Envoy, nginx)."
    )
    header_timeout: Duration = fld(
        Duration(10),
        "Time a client has to send a request's headers, from its first byte (or from the "
        "connection's opening): a slowloris client is cut off after it.",
    )
    max_per_address: int = fld(
        1024,
        "Open connections from one client address; more are closed at once (behind an "
        "ingress or a proxy every client has its address: size this for it).",
        minimum=1,
    )
    max_total: int = fld(
        4096,
        "Open client connections in all; more are closed at once (keep it below the "
        "process's file-descriptor limit, with room for engine connections).",
        minimum=1,
    )


@dataclass(frozen=True, kw_only=True)
class Listen:
    host: str = fld("0.0.0.0", "Address to listen on.")
    port: int = fld(8080, "Port of the API (clients).", minimum=1, maximum=65535)
    metrics_port: int = fld(
        9090,
        "Port of /metrics, apart from the API: the metrics name tenants, budgets, costs and"
        " backend addresses, so only scrapers (not clients) should reach it.",
        minimum=1,
        maximum=65535,
    )
    connections: Connections = fld(Connections, "Limits on client connections.")


@dataclass(frozen=True, kw_only=True)
class CacheGroup:
    name: str = fld(doc="The group's name (it names the shared namespace).")
    tenants: tuple[str, ...] = fld(doc="Tenants whose prompts share one prefix cache.")


@dataclass(frozen=True, kw_only=True)
class CacheIsolation:
    """Who shares the engines' prefix cache. A shared cache tells a tenant what others sent:
    a prompt that hits reports its cached tokens (`usage.prompt_tokens_details.cached_tokens`)
    and answers sooner, so guessing another tenant's prompt one candidate at a time works.
    Isolated, each request carries a cache salt derived from its tenant (SGLang's
    `cache_salt`), and the gateway's prefix indexes are keyed on it too."""

    mode: Literal["tenant", "shared"] = fld(
        "tenant",
        "tenant: a tenant's prompts reuse only prefixes it (or its group) cached; shared: one "
        "cache for everyone (only where every tenant may see every other's prompts).",
    )
    groups: tuple[CacheGroup, ...] = fld(
        (),
        "Tenants that share a namespace, e.g. the teams of one organisation, or the tenants a "
        "platform sends its common system prompt.",
    )


@dataclass(frozen=True, kw_only=True)
class Auth:
    keys_file: str | None = fld(None, "File of tenants and SHA-256 key hashes (kvfleet keys).")
    insecure_no_auth: bool = fld(
        False, "Serve without API keys (everyone is tenant `anonymous`). Never in production."
    )


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    connect: Duration = fld(Duration(5), "Connecting to an engine.")
    first_byte: Duration = fld(
        Duration(120), "Upstream time to the first byte (includes queueing and prefill)."
    )
    idle: Duration = fld(Duration(60), "Longest silence between two chunks of an upstream stream.")
    whole_response: Duration = fld(
        Duration(1800),
        "Cap on a non-streaming request's deadline. An engine answers a non-streaming request "
        "only when it has generated the whole reply, so its deadline is firstByte + "
        "max_tokens / minDecodeRate, at most this.",
    )
    min_decode_rate: float = fld(
        5.0,
        "Tokens per second a non-streaming reply is given at the least (see wholeResponse).",
        minimum=0.1,
    )
    client_body: Duration = fld(Duration(30), "Time a client has to send its request body.")
    client_write: Duration = fld(
        Duration(30), "Time a slow client may take to accept one chunk before it is cut off."
    )
    drain: Duration = fld(
        Duration(45),
        "At shutdown (SIGTERM), how long requests in flight may finish; keep it below the"
        " pod's terminationGracePeriodSeconds.",
    )


@dataclass(frozen=True, kw_only=True)
class Hold:
    """Requests that arrive while no replica can serve their model (scaled to zero, all
    replicas starting) wait here for the autoscaler to bring one, instead of failing."""

    timeout: Duration = fld(
        Duration(300),
        "Longest wait for a replica; then 503 no_capacity with Retry-After, nothing billed.",
    )
    max_requests: int = fld(1000, "Requests held at once; more are refused at once.", minimum=0)


@dataclass(frozen=True, kw_only=True)
class WorkBounds:
    """Request fields that cost engine work beyond the tokens billed, bounded (each over its
    bound is a 400 naming the field and this setting)."""

    top_logprobs: int = fld(
        20,
        "Most alternatives per token a client may ask for (chat top_logprobs, completions "
        "logprobs, /generate top_logprobs_num), as OpenAI allows.",
        minimum=0,
    )
    token_ids_logprob: int = fld(20, "Most ids in /generate's token_ids_logprob.", minimum=0)
    prompt_logprobs: bool = fld(
        False,
        "Whether a client may ask for logprobs over its whole prompt (/generate "
        "logprob_start_len >= 0, completions echo with logprobs): work per prompt token.",
    )
    logit_bias: int = fld(300, "Most logit_bias entries, as OpenAI allows.", minimum=0)
    stop: int = fld(16, "Most entries of stop, stop_regex and stop_token_ids, each.", minimum=0)
    stop_bytes: int = fld(256, "Longest stop string or stop regex, in bytes.", minimum=1)
    grammar_bytes: int = fld(
        16384,
        "Largest regex, ebnf or json_schema (response_format's included) a client may send, "
        "in bytes: the engine compiles it before the first token.",
        minimum=1,
    )


@dataclass(frozen=True, kw_only=True)
class Requests:
    """What clients may send (kvfleet_gateway.allowlist has the lists)."""

    unknown_fields: Literal["reject", "drop"] = fld(
        "reject", "A field the gateway does not know: refused with 400, or dropped."
    )
    allow: tuple[Governed, ...] = fld(
        (),
        "Engine extras clients may use, each refused with 400 unless listed here:"
        " lora_path, custom_logit_processor, custom_params, priority, return_hidden_states,"
        " return_routed_experts.",
    )
    bounds: WorkBounds = fld(WorkBounds, "Bounds on fields that cost engine work.")
    compressed_bodies: bool = fld(
        False,
        "Accept request bodies with a Content-Encoding (gzip, deflate): a 6 KB gzip can "
        "inflate to megabytes to parse. Off: 415 before the body is read.",
    )
    body_bytes_per_second: int = fld(
        4 * 2**20,
        "Request-body bytes per second one tenant may have this gateway read and parse (a "
        "bucket of twice maxBodyBytes): past it, 429 before the body is read.",
        minimum=1024,
    )
    max_json_containers: int = fld(
        10_000,
        "Most JSON objects and arrays a request body may hold (counted before it is "
        "decoded): thousands of small nested lists cost a second to decode and walk.",
        minimum=16,
    )


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """The kvfleet gateway's configuration."""

    RULES: ClassVar = (
        Rule(
            "has(self.auth.keysFile) || self.auth.insecureNoAuth",
            "auth.keysFile is required (or set auth.insecureNoAuth: true)",
            ".auth.keysFile",
        ),
        Rule(
            "has(self.backends) != (size(self.pools) > 0 || has(self.poolsFile))",
            "give backends (one pool) or pools/poolsFile (many), not both",
            ".backends",
        ),
    )
    listen: Listen = fld(Listen, "Where the gateway listens.")
    models: tuple[ModelConfig, ...] = fld((), "Models served; empty: learned from backends.")
    backends: Backends | None = fld(
        None, "The engine replicas (one pool; `pools` or `poolsFile` for many)."
    )
    pools: tuple[PoolConfig, ...] = fld(
        (),
        "Many pools behind this gateway, each with its models, engines, routing, LoRA and"
        " fairness; a request goes to the pool serving its `model`.",
        max_items=500,
    )
    pools_file: str | None = fld(
        None,
        "A file of pools (`pools: [...]`), re-read when it changes: pools are added and"
        " removed without a restart (the operator mounts it for an InferenceGateway).",
    )
    routing: Routing = fld(Routing, "Replica selection.")
    cache_isolation: CacheIsolation = fld(
        CacheIsolation, "Who shares the engines' prefix cache (default: no one)."
    )
    auth: Auth = fld(Auth, "API keys.")
    limits: LimitsConfig = fld(LimitsConfig, "Rate limits, concurrency and token budgets.")
    cost: CostConfig = fld(CostConfig, "Cost accounting.")
    timeouts: Timeouts = fld(Timeouts, "Upstream and client timeouts.")
    hold: Hold = fld(Hold, "Waiting for capacity (scale from zero).")
    fairness: Fairness = fld(Fairness, "Fair sharing and shedding under overload.")
    lora: Lora = fld(Lora, "LoRA adapters: routed by affinity, loaded on demand.")
    requests: Requests = fld(Requests, "Which request fields are forwarded to engines.")
    max_body_bytes: int = fld(4 * 2**20, "Largest request body accepted.", minimum=1024)
    health_interval: Duration = fld(Duration(2), "Period of active /health checks.")
    access_log: bool = fld(True, "Log one line per request (never prompts or keys).")

    def __post_init__(self) -> None:
        check_unique(self.pools, "pools")

    @staticmethod
    def from_dict(doc: Any) -> GatewayConfig:
        return parse(GatewayConfig, doc)

    def single_pool(self) -> PoolConfig | None:
        """The one pool of a gateway configured with top-level `backends` (None: `pools`)."""
        if self.backends is None:
            return None
        return PoolConfig(
            name="default",
            models=self.models,
            backends=self.backends,
            routing=self.routing,
            cost=self.cost,
            fairness=self.fairness,
            lora=self.lora,
        )

    def to_dict(self) -> dict[str, Any]:
        """The document `from_dict` reads (what the operator writes into the ConfigMap)."""
        out: dict[str, Any] = to_json(self)
        return out

    def limits_for(self, tenant: str, key_limits: Limits | None = None) -> Limits:
        """Defaults, then the config's tenant override, then the keys file's."""
        override = next((t.limits for t in self.limits.tenants if t.name == tenant), None)
        return self.limits.defaults.merged(override).merged(key_limits)


def load_config(path: Path) -> GatewayConfig:
    try:
        text = path.read_text()
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        where = yaml_position(exc)
        problem = getattr(exc, "problem", None) or "malformed"
        raise ConfigError(
            str(path), f"invalid YAML at {where}: {problem}" if where else problem
        ) from exc
    except ValueError as exc:  # JSON
        raise ConfigError(str(path), f"invalid JSON: {exc}") from exc
    try:
        return GatewayConfig.from_dict(doc)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc.path}" if exc.path else str(path), exc.message) from exc
