"""What one pool of engines serves and how its replicas are picked: the per-pool part of the
gateway's configuration (a gateway fronts one pool, or many in `pools`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from kvfleet_gateway.routing import DEFAULT_POLICY, POLICY_NAMES, KvfleetTuning
from kvfleet_kernel.schema import Duration, Rule, fld

MODEL_NAME_PATTERN = r"^[^:\s]+$"
"""A served model name or alias: no `:` (it separates `<base>:<adapter>`, so an alias
`base:adapter` would claim another service's adapter on a shared gateway), no whitespace."""


@dataclass(frozen=True, kw_only=True)
class Price:
    """What a model's tokens cost, per million (any currency, the same for every model a
    gateway fronts): what cost budgets and the cost metrics count, so a 70B model's token
    is not billed as an 8B model's."""

    prompt: float = fld(doc="Per million uncached prompt tokens.", minimum=0)
    cached: float | None = fld(
        None,
        "Per million prompt tokens read from the prefix cache; unset: the prompt price.",
        minimum=0,
    )
    output: float = fld(doc="Per million output tokens.", minimum=0)

    def cost(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> float:
        """What a request that used these tokens costs (`cached_tokens` of `prompt_tokens`)."""
        cached = min(cached_tokens, prompt_tokens)
        cached_price = self.prompt if self.cached is None else self.cached
        return (
            (prompt_tokens - cached) * self.prompt
            + cached * cached_price
            + output_tokens * self.output
        ) / 1e6

    def bound(self, prompt_tokens: int, max_tokens: int) -> float:
        """The most a request may cost: its whole prompt uncached and every output token."""
        return (prompt_tokens * self.prompt + max_tokens * self.output) / 1e6


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = fld(
        doc="Served model name, as clients send it in `model` (no `:`: it separates an"
        " adapter, `<base>:<adapter>`).",
        pattern=MODEL_NAME_PATTERN,
        max_length=256,
    )
    context_length: int | None = fld(
        None, "Context length; unset: learned from the backends' /v1/models.", minimum=1
    )
    aliases: tuple[str, ...] = fld(
        (),
        "Other names clients may send in `model` for it (no `:`, as names).",
        max_items=32,
        pattern=MODEL_NAME_PATTERN,
        max_length=256,
    )
    price: Price | None = fld(
        None, "What its tokens cost (cost budgets and metrics); unset: it costs nothing."
    )
    owned_by: str = fld("kvfleet", "`owned_by` in /v1/models.")


@dataclass(frozen=True, kw_only=True)
class KubernetesBackends:
    namespace: str = fld(doc="Namespace of the engine pods.")
    selector: str = fld(doc="Label selector of the engine pods, e.g. `kvfleet.dev/role=active`.")
    port: int = fld(30000, "The engines' HTTP port.", minimum=1, maximum=65535)
    kubeconfig: str | None = fld(
        None, "Kubeconfig outside a cluster; in a pod the service account is used."
    )


@dataclass(frozen=True, kw_only=True)
class PrefillEngine:
    url: str = fld(doc="A prefill engine's base URL.", pattern=r"^https?://[^/\s]+")
    bootstrap_port: int | None = fld(
        None, "Its --disaggregation-bootstrap-port; unset: the pool's.", minimum=1, maximum=65535
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", self.url.rstrip("/"))


@dataclass(frozen=True, kw_only=True)
class PrefillBackends:
    """Disaggregated serving (SGLang's PD mode): the prefill engines. The gateway sends each
    request to a prefill engine and a decode engine (the `static`/`kubernetes` backends)
    with SGLang's bootstrap fields, and streams the decode engine's answer."""

    RULES: ClassVar = (
        Rule(
            "size(self.static) > 0 || has(self.kubernetes)",
            "give static URLs or a kubernetes selector for the prefill engines",
        ),
    )
    static: tuple[PrefillEngine, ...] = fld((), "Prefill engines by URL.")
    kubernetes: KubernetesBackends | None = fld(None, "Prefill engine pods by label selector.")
    bootstrap_port: int = fld(
        8998,
        "The prefill engines' --disaggregation-bootstrap-port (sent as bootstrap_port).",
        minimum=1,
        maximum=65535,
    )

    def bootstrap_port_of(self, url: str) -> int:
        for engine in self.static:
            if engine.url == url and engine.bootstrap_port is not None:
                return engine.bootstrap_port
        return self.bootstrap_port


@dataclass(frozen=True, kw_only=True)
class Backends:
    RULES: ClassVar = (
        Rule(
            "size(self.static) > 0 || has(self.kubernetes)",
            "give static URLs or a kubernetes selector",
        ),
    )
    static: tuple[str, ...] = fld((), "Engine base URLs.", pattern=r"^https?://[^/\s]+")
    kubernetes: KubernetesBackends | None = fld(None, "Engine pods found by label selector.")
    prefill: PrefillBackends | None = fld(
        None,
        "Prefill/decode disaggregation: the prefill pool; the backends above are then the"
        " decode pool. The routing policy chooses the prefill engine (prefix hits live there);"
        " the decode engine is the least loaded.",
    )
    engine_api_key_file: str | None = fld(
        None,
        "A file holding the engines' API key (SGLang's --api-key), sent to every engine as"
        " 'Authorization: Bearer'; read at start. The operator mounts it from the"
        " InferenceService's <name>-engine-key Secret. Unset: engines without a key.",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "static", tuple(u.rstrip("/") for u in self.static))


@dataclass(frozen=True, kw_only=True)
class PrefixIndexConfig:
    """Where the kvfleet policy learns which replica holds which prompt prefix."""

    RULES: ClassVar = (
        Rule(
            "self.source != 'events' || has(self.tokenizer)",
            "source: events needs the model's tokenizer (a directory with tokenizer.json)",
            ".tokenizer",
        ),
    )
    source: Literal["approximate", "events"] = fld(
        "approximate",
        "approximate: from what this gateway sent where. events: exact, from the engines'"
        " KV-cache events (engines started with --kv-events-config; approximate for an"
        " engine whose stream is down).",
    )
    tokenizer: str | None = fld(
        None,
        "Directory holding the model's tokenizer.json and tokenizer_config.json, to hash"
        " prompts as the engine does (events).",
    )


@dataclass(frozen=True, kw_only=True)
class Routing:
    RULES: ClassVar = (
        Rule(
            "self.prefixIndex.source != 'events' || self.policy == 'kvfleet'",
            "prefixIndex.source: events is read by the kvfleet policy only",
            ".prefixIndex",
        ),
    )
    policy: str = fld(DEFAULT_POLICY, "How a replica is picked.", enum=POLICY_NAMES)
    scrape_interval: Duration = fld(
        Duration(1), "How often each engine's /metrics is read for routing signals."
    )
    tuning: KvfleetTuning = fld(KvfleetTuning, "The kvfleet policy's model of a replica.")
    prefix_index: PrefixIndexConfig = fld(
        PrefixIndexConfig, "Where prefix-cache state comes from (kvfleet policy)."
    )


@dataclass(frozen=True, kw_only=True)
class CostConfig:
    gpu_hourly_price: float = fld(
        0.0, "Price of one GPU-hour (any currency); 0 reports GPU-seconds only.", minimum=0
    )
    gpus_per_replica: int = fld(1, "GPUs of one engine replica.", minimum=1)
    prefill_tokens_per_second: float = fld(
        20_000.0, "Uncached prompt tokens one replica computes per second.", minimum=1
    )
    decode_tokens_per_second: float = fld(
        3_000.0, "Output tokens one replica generates per second across its batch.", minimum=1
    )
