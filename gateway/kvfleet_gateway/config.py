"""The gateway's configuration: one YAML/JSON document, the contract the operator renders.

camelCase keys, parsed once at start into frozen dataclasses; every error names the field
path (`limits.tenants[1].limits.tokenBudget.period: ...`). `GatewayConfig.from_dict` is the
only entry point, and `to_dict` renders it back (the operator's ConfigMap round-trips).

    listen: {host: 0.0.0.0, port: 8080}
    models: [{name: llama-3.1-8b, contextLength: 131072}]     # empty: learn from backends
    backends:
      static: [http://10.0.0.1:30000]                        # or
      kubernetes: {namespace: ai, selector: "app=x", port: 30000}
    routing: {policy: kvfleet, prefillTokensPerSecond: 30000}
    auth: {keysFile: /etc/kvfleet/keys/keys.yaml, insecureNoAuth: false}
    limits:
      store: memory                                          # or redis://host:6379/0
      defaults: {requestsPerMinute: 600, tokensPerMinute: 200000, maxConcurrent: 16,
                 maxTokens: 4096, defaultMaxTokens: 512,
                 tokenBudget: {tokens: 10000000, period: 30d}}
      tenants: [{name: team-a, limits: {maxConcurrent: 64}}]
      redisOutage: {gatewayReplicas: 2}
    cost: {gpuHourlyPrice: 4.0, gpusPerReplica: 1, prefillTokensPerSecond: 20000,
           decodeTokensPerSecond: 3000}
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from kvfleet_gateway.routing import DEFAULT_POLICY, POLICIES, KvfleetTuning


class ConfigError(ValueError):
    """A configuration problem; the message starts with the field path."""


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: Any, path: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    m = _DURATION.match(str(value).strip()) if isinstance(value, str) else None
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"{path}: {value!r} is not a duration like 30s, 1h, 1d, 30d")
    return float(m.group(1)) * _UNITS[m.group(2)]


def format_duration(seconds: float) -> str:
    for unit in ("d", "h", "m"):
        if seconds % _UNITS[unit] == 0:
            return f"{int(seconds // _UNITS[unit])}{unit}"
    return f"{seconds:g}s"


class _Reader:
    """Typed access to one mapping of the document, remembering where it is."""

    def __init__(self, data: Any, path: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path or '<root>'}: expected a mapping, got {type(data).__name__}")
        self.data, self.path = data, path
        self._seen: set[str] = set()

    def _p(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str) -> Any:
        self._seen.add(key)
        return self.data.get(key)

    def get_int(self, key: str, default: int | None, minimum: int = 0) -> int | None:
        v = self.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(f"{self._p(key)}: expected an integer >= {minimum}, got {v!r}")
        return v

    def get_float(self, key: str, default: float, minimum: float = 0.0) -> float:
        v = self.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < minimum:
            raise ConfigError(f"{self._p(key)}: expected a number >= {minimum}, got {v!r}")
        return float(v)

    def get_str(self, key: str, default: str | None) -> str | None:
        v = self.get(key)
        if v is None:
            return default
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{self._p(key)}: expected a non-empty string, got {v!r}")
        return v

    def get_bool(self, key: str, default: bool) -> bool:
        v = self.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ConfigError(f"{self._p(key)}: expected true or false, got {v!r}")
        return v

    def get_list(self, key: str) -> list[Any]:
        v = self.get(key)
        if v is None:
            return []
        if not isinstance(v, list):
            raise ConfigError(f"{self._p(key)}: expected a list, got {type(v).__name__}")
        return v

    def child(self, key: str) -> _Reader:
        return _Reader(self.get(key), self._p(key))

    def done(self) -> None:
        unknown = sorted(set(self.data) - self._seen)
        if unknown:
            raise ConfigError(f"{self.path or '<root>'}: unknown field(s) {', '.join(unknown)}")


@dataclass(frozen=True)
class TokenBudget:
    tokens: int
    """Tokens (prompt + completion) a tenant may use per period."""
    period_s: float
    """Budget period in seconds; budgets reset at multiples of it since the Unix epoch."""


@dataclass(frozen=True)
class Limits:
    """Per-tenant limits. `None` = unlimited (never the case for an unset field with defaults)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    """Reserved prompt + max_tokens at admission, settled to real usage at the end."""
    max_concurrent: int | None = None
    max_tokens: int | None = None
    """Cap on a request's max_tokens; larger requests are refused with 400."""
    default_max_tokens: int | None = None
    """Injected when a request sets no max_tokens (else: the cap, else the model's room)."""
    token_budget: TokenBudget | None = None

    def merged(self, override: Limits | None) -> Limits:
        """`override`'s set fields win over ours."""
        if override is None:
            return self
        changes = {
            f.name: getattr(override, f.name)
            for f in fields(Limits)
            if getattr(override, f.name) is not None
        }
        return replace(self, **changes)


def parse_limits(r: _Reader) -> Limits:
    budget = None
    if r.get("tokenBudget") is not None:
        b = r.child("tokenBudget")
        tokens = b.get_int("tokens", None, minimum=1)
        if tokens is None:
            raise ConfigError(f"{b.path}.tokens: required")
        budget = TokenBudget(tokens, parse_duration(b.get("period") or "30d", f"{b.path}.period"))
        b.done()
    limits = Limits(
        requests_per_minute=r.get_int("requestsPerMinute", None, 1),
        tokens_per_minute=r.get_int("tokensPerMinute", None, 1),
        max_concurrent=r.get_int("maxConcurrent", None, 1),
        max_tokens=r.get_int("maxTokens", None, 1),
        default_max_tokens=r.get_int("defaultMaxTokens", None, 1),
        token_budget=budget,
    )
    r.done()
    if (
        limits.max_tokens
        and limits.default_max_tokens
        and limits.default_max_tokens > limits.max_tokens
    ):
        raise ConfigError(f"{r.path}.defaultMaxTokens: larger than maxTokens")
    return limits


def limits_to_dict(limits: Limits) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, attr in (
        ("requestsPerMinute", "requests_per_minute"),
        ("tokensPerMinute", "tokens_per_minute"),
        ("maxConcurrent", "max_concurrent"),
        ("maxTokens", "max_tokens"),
        ("defaultMaxTokens", "default_max_tokens"),
    ):
        if getattr(limits, attr) is not None:
            out[key] = getattr(limits, attr)
    if limits.token_budget is not None:
        out["tokenBudget"] = {
            "tokens": limits.token_budget.tokens,
            "period": format_duration(limits.token_budget.period_s),
        }
    return out


@dataclass(frozen=True)
class ModelConfig:
    name: str
    context_length: int | None = None
    """Known context length; None = learn it from the backends' /v1/models."""


@dataclass(frozen=True)
class KubernetesBackends:
    namespace: str
    selector: str
    """Label selector of the engine pods, e.g. `kvfleet.dev/role=active`."""
    port: int = 30000


@dataclass(frozen=True)
class Backends:
    static: tuple[str, ...] = ()
    kubernetes: KubernetesBackends | None = None


@dataclass(frozen=True)
class CostConfig:
    gpu_hourly_price: float = 0.0
    """Price of one GPU-hour (any currency); 0 reports GPU-seconds only."""
    gpus_per_replica: int = 1
    prefill_tokens_per_second: float = 20_000.0
    """Uncached prompt tokens one replica computes per second at its working point."""
    decode_tokens_per_second: float = 3_000.0
    """Output tokens one replica generates per second across its batch at its working point."""


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 5.0
    first_byte_s: float = 120.0
    """Upstream time to the first byte (includes queueing and prefill)."""
    idle_s: float = 60.0
    """Longest silence between two chunks of an upstream stream."""
    client_body_s: float = 30.0
    """Time a client has to send its request body."""
    client_write_s: float = 30.0
    """Time a slow client may take to accept one chunk before it is cut off."""


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int = 8080
    models: tuple[ModelConfig, ...] = ()
    backends: Backends = field(default_factory=Backends)
    routing_policy: str = DEFAULT_POLICY
    """One of `routing.POLICIES`; `kvfleet` estimates each replica's time to first token."""
    routing_tuning: KvfleetTuning = field(default_factory=KvfleetTuning)
    scrape_interval_s: float = 1.0
    """How often each engine's /metrics is read for routing signals."""
    keys_file: Path | None = None
    insecure_no_auth: bool = False
    """Serve without API keys (everyone is tenant `anonymous`); refused unless said explicitly."""
    store: str = "memory"
    """`memory` (one gateway replica) or a `redis://` URL shared by all replicas."""
    default_limits: Limits = field(default_factory=Limits)
    tenant_limits: tuple[tuple[str, Limits], ...] = ()
    gateway_replicas: int = 1
    """Used when Redis is down: each replica then enforces 1/N of every rate limit locally."""
    lease_ttl_s: float = 60.0
    """Concurrency leases expire after this long without a heartbeat (a crashed gateway)."""
    max_body_bytes: int = 4 * 2**20
    cost: CostConfig = field(default_factory=CostConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    kubeconfig: str | None = None
    """For `backends.kubernetes` outside a cluster; in a pod the service account is used."""
    health_interval_s: float = 2.0
    access_log: bool = True

    @staticmethod
    def from_dict(doc: Any) -> GatewayConfig:
        root = _Reader(doc, "")
        listen = root.child("listen")
        host = listen.get_str("host", "0.0.0.0") or "0.0.0.0"
        port = listen.get_int("port", 8080, 1) or 8080
        listen.done()
        models = []
        for i, m in enumerate(root.get_list("models")):
            if isinstance(m, str):
                models.append(ModelConfig(m))
                continue
            mr = _Reader(m, f"models[{i}]")
            name = mr.get_str("name", None)
            if name is None:
                raise ConfigError(f"models[{i}].name: required")
            models.append(ModelConfig(name, mr.get_int("contextLength", None, 1)))
            mr.done()
        b = root.child("backends")
        static = []
        for i, url in enumerate(b.get_list("static")):
            if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+", url):
                raise ConfigError(f"backends.static[{i}]: {url!r} is not an http(s) URL")
            static.append(url.rstrip("/"))
        kube = None
        kubeconfig = None
        if b.get("kubernetes") is not None:
            k = b.child("kubernetes")
            ns, sel = k.get_str("namespace", None), k.get_str("selector", None)
            if ns is None or sel is None:
                raise ConfigError("backends.kubernetes: namespace and selector are required")
            kube = KubernetesBackends(ns, sel, k.get_int("port", 30000, 1) or 30000)
            kubeconfig = k.get_str("kubeconfig", None)
            k.done()
        b.done()
        if not static and kube is None:
            raise ConfigError("backends: give static URLs or a kubernetes selector")
        routing = root.child("routing")
        policy = routing.get_str("policy", DEFAULT_POLICY) or DEFAULT_POLICY
        if policy not in POLICIES:
            raise ConfigError(f"routing.policy: {policy!r} is not one of {', '.join(POLICIES)}")
        d_t = KvfleetTuning()
        tuning = KvfleetTuning(
            prefill_tokens_per_second=routing.get_float(
                "prefillTokensPerSecond", d_t.prefill_tokens_per_second, 1.0
            ),
            decode_step_base_s=routing.get_float("decodeStepBase", d_t.decode_step_base_s),
            kv_read_s_per_token=routing.get_float("kvReadPerToken", d_t.kv_read_s_per_token),
            retraction_penalty_s=routing.get_float("retractionPenalty", d_t.retraction_penalty_s),
            miss_weight=routing.get_float("missWeight", d_t.miss_weight),
            overload_tolerance=routing.get_float("overloadTolerance", d_t.overload_tolerance),
        )
        scrape = parse_duration(routing.get("scrapeInterval") or 1, "routing.scrapeInterval")
        routing.done()
        auth = root.child("auth")
        keys_file = auth.get_str("keysFile", None)
        insecure = auth.get_bool("insecureNoAuth", False)
        auth.done()
        lim = root.child("limits")
        store = lim.get_str("store", "memory") or "memory"
        if store != "memory" and not store.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"limits.store: {store!r} must be 'memory' or a redis:// URL")
        defaults = parse_limits(lim.child("defaults"))
        tenants = []
        for i, t in enumerate(lim.get_list("tenants")):
            tr = _Reader(t, f"limits.tenants[{i}]")
            name = tr.get_str("name", None)
            if name is None:
                raise ConfigError(f"limits.tenants[{i}].name: required")
            tenants.append((name, parse_limits(tr.child("limits"))))
            tr.done()
        outage = lim.child("redisOutage")
        replicas = outage.get_int("gatewayReplicas", 1, 1) or 1
        outage.done()
        lease_ttl = parse_duration(lim.get("leaseTtl") or 60, "limits.leaseTtl")
        lim.done()
        c = root.child("cost")
        cost = CostConfig(
            gpu_hourly_price=c.get_float("gpuHourlyPrice", 0.0),
            gpus_per_replica=c.get_int("gpusPerReplica", 1, 1) or 1,
            prefill_tokens_per_second=c.get_float("prefillTokensPerSecond", 20_000.0, 1.0),
            decode_tokens_per_second=c.get_float("decodeTokensPerSecond", 3_000.0, 1.0),
        )
        c.done()
        t = root.child("timeouts")
        d = Timeouts()
        timeouts = Timeouts(
            connect_s=parse_duration(t.get("connect") or d.connect_s, "timeouts.connect"),
            first_byte_s=parse_duration(t.get("firstByte") or d.first_byte_s, "timeouts.firstByte"),
            idle_s=parse_duration(t.get("idle") or d.idle_s, "timeouts.idle"),
            client_body_s=parse_duration(
                t.get("clientBody") or d.client_body_s, "timeouts.clientBody"
            ),
            client_write_s=parse_duration(
                t.get("clientWrite") or d.client_write_s, "timeouts.clientWrite"
            ),
        )
        t.done()
        max_body = root.get_int("maxBodyBytes", 4 * 2**20, 1024) or 4 * 2**20
        access_log = root.get_bool("accessLog", True)
        health = parse_duration(root.get("healthInterval") or 2, "healthInterval")
        root.done()
        if keys_file is None and not insecure:
            raise ConfigError("auth.keysFile: required (or set auth.insecureNoAuth: true)")
        return GatewayConfig(
            host=host,
            port=port,
            models=tuple(models),
            backends=Backends(tuple(static), kube),
            routing_policy=policy,
            routing_tuning=tuning,
            scrape_interval_s=scrape,
            keys_file=Path(keys_file) if keys_file else None,
            insecure_no_auth=insecure,
            store=store,
            default_limits=defaults,
            tenant_limits=tuple(tenants),
            gateway_replicas=replicas,
            lease_ttl_s=lease_ttl,
            max_body_bytes=max_body,
            cost=cost,
            timeouts=timeouts,
            health_interval_s=health,
            kubeconfig=kubeconfig,
            access_log=access_log,
        )

    def to_dict(self) -> dict[str, Any]:
        """The document `from_dict` reads (what the operator writes into the ConfigMap)."""
        backends: dict[str, Any] = {}
        if self.backends.static:
            backends["static"] = list(self.backends.static)
        if self.backends.kubernetes:
            k = self.backends.kubernetes
            backends["kubernetes"] = {
                "namespace": k.namespace,
                "selector": k.selector,
                "port": k.port,
                **({"kubeconfig": self.kubeconfig} if self.kubeconfig else {}),
            }
        auth: dict[str, Any] = {"insecureNoAuth": self.insecure_no_auth}
        if self.keys_file:
            auth["keysFile"] = str(self.keys_file)
        t = self.timeouts
        return {
            "listen": {"host": self.host, "port": self.port},
            "models": [
                {
                    "name": m.name,
                    **({"contextLength": m.context_length} if m.context_length else {}),
                }
                for m in self.models
            ],
            "backends": backends,
            "routing": {
                "policy": self.routing_policy,
                "prefillTokensPerSecond": self.routing_tuning.prefill_tokens_per_second,
                "decodeStepBase": self.routing_tuning.decode_step_base_s,
                "kvReadPerToken": self.routing_tuning.kv_read_s_per_token,
                "retractionPenalty": self.routing_tuning.retraction_penalty_s,
                "missWeight": self.routing_tuning.miss_weight,
                "overloadTolerance": self.routing_tuning.overload_tolerance,
                "scrapeInterval": format_duration(self.scrape_interval_s),
            },
            "auth": auth,
            "limits": {
                "store": self.store,
                "defaults": limits_to_dict(self.default_limits),
                "tenants": [
                    {"name": n, "limits": limits_to_dict(lim)} for n, lim in self.tenant_limits
                ],
                "redisOutage": {"gatewayReplicas": self.gateway_replicas},
                "leaseTtl": format_duration(self.lease_ttl_s),
            },
            "cost": {
                "gpuHourlyPrice": self.cost.gpu_hourly_price,
                "gpusPerReplica": self.cost.gpus_per_replica,
                "prefillTokensPerSecond": self.cost.prefill_tokens_per_second,
                "decodeTokensPerSecond": self.cost.decode_tokens_per_second,
            },
            "timeouts": {
                "connect": format_duration(t.connect_s),
                "firstByte": format_duration(t.first_byte_s),
                "idle": format_duration(t.idle_s),
                "clientBody": format_duration(t.client_body_s),
                "clientWrite": format_duration(t.client_write_s),
            },
            "maxBodyBytes": self.max_body_bytes,
            "healthInterval": format_duration(self.health_interval_s),
            "accessLog": self.access_log,
        }

    def limits_for(self, tenant: str, key_limits: Limits | None = None) -> Limits:
        """Defaults, then the config's tenant override, then the keys file's."""
        override = dict(self.tenant_limits).get(tenant)
        return self.default_limits.merged(override).merged(key_limits)


def load_config(path: Path) -> GatewayConfig:
    try:
        text = path.read_text()
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    return GatewayConfig.from_dict(doc)
