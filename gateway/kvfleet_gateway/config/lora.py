"""The gateway's `lora:` settings: the adapters it may load on demand, and the bounds."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_kernel.schema import Duration, fld

ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
"""A LoRA adapter's name (what clients put in `model`): the gateway's and the CRD's rule."""


@dataclass(frozen=True, kw_only=True)
class AdapterSource:
    name: str = fld(
        doc="The adapter's name: what clients put in `model` (alone or as <base>:<name>).",
        pattern=ADAPTER_NAME_PATTERN,
        max_length=128,
    )
    path: str = fld(doc="Where the engines load it from (SGLang's lora_path).", max_length=1024)
    base: str | None = fld(None, "The base model it adapts; unset: the only served model.")


@dataclass(frozen=True, kw_only=True)
class Lora:
    """LoRA adapters: a request for one goes to a replica that holds it (known from the
    engines' /v1/models), balanced with load and prefix hits; when none holds it, a replica
    loads it first (SGLang's /load_lora_adapter), unloading its least recently used adapter
    when it holds `maxAdaptersPerReplica`."""

    adapters: tuple[AdapterSource, ...] = fld((), "Adapters loaded on demand.", max_items=10000)
    max_adapters_per_replica: int = fld(
        8,
        "Adapters one replica holds at once (at most the engines' --max-loaded-loras).",
        minimum=1,
    )
    max_concurrent_loads: int = fld(1, "Adapter loads at once on one replica.", minimum=1)
    tenant_loads_per_minute: int = fld(
        10,
        "Adapter loads one tenant's requests may cause per minute on this gateway; past it, a"
        " request whose adapter no replica holds is refused with 429 (requests for held"
        " adapters still pass).",
        minimum=1,
    )
    load_charge_tokens: int = fld(
        512,
        "Tokens billed to the tenant whose request caused an adapter load (reserved with every"
        " adapter request, settled only when it loaded; at the prompt price on cost budgets):"
        " a load costs the replica what a prompt of that size does.",
        minimum=0,
    )
    min_residency: Duration = fld(
        Duration(10),
        "An adapter loaded more recently than this is not unloaded to make room: one tenant"
        " cycling adapters cannot evict another's faster (past it, 503 with Retry-After).",
    )
