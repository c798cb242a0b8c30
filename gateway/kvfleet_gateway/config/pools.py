"""A shared gateway's pools: each fronts one InferenceService's engines and serves its models,
its aliases and its adapters; requests are sent to the pool that serves their `model`.

The pools can live in their own file (`poolsFile`, a mounted Secret or ConfigMap): the gateway
re-reads it when it changes and starts or stops pools in place, so adding a service needs no
restart. A relative `engineApiKeyFile` there names a file beside it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import yaml

from kvfleet_gateway.config.fairness import Fairness
from kvfleet_gateway.config.lora import Lora
from kvfleet_gateway.config.serving import Backends, CostConfig, ModelConfig, Routing
from kvfleet_kernel.schema import ConfigError, Rule, fld, parse


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """One pool of engine replicas and what it serves."""

    RULES: ClassVar = (
        Rule("size(self.models) > 0", "a pool names the models it serves", ".models"),
    )
    name: str = fld(
        doc="The pool's name (the InferenceService's namespace/name).",
        pattern=r"^[a-z0-9]([-a-z0-9./]*[a-z0-9])?$",
        max_length=253,
    )
    models: tuple[ModelConfig, ...] = fld(doc="Models it serves (their names and aliases).")
    backends: Backends = fld(doc="Its engine replicas.")
    routing: Routing = fld(Routing, "Replica selection.")
    cost: CostConfig = fld(CostConfig, "GPU cost accounting.")
    fairness: Fairness = fld(Fairness, "Fair sharing and shedding under overload.")
    lora: Lora = fld(Lora, "LoRA adapters of its base model.")

    def names(self) -> list[str]:
        """Every name a client may send for its models: served names, then aliases."""
        return [m.name for m in self.models] + [a for m in self.models for a in m.aliases]


@dataclass(frozen=True, kw_only=True)
class PoolsDocument:
    """The file `poolsFile` names."""

    pools: tuple[PoolConfig, ...] = fld((), "The pools.", max_items=500)


def check_unique(pools: tuple[PoolConfig, ...], where: str) -> None:
    """Pool names and the model names they claim are each claimed once."""
    seen_pools: set[str] = set()
    owner: dict[str, str] = {}
    for i, pool in enumerate(pools):
        if pool.name in seen_pools:
            raise ConfigError(f"{where}[{i}].name", f"pool {pool.name!r} is named twice")
        seen_pools.add(pool.name)
        for name in pool.names() + [a.name for a in pool.lora.adapters]:
            if name in owner and owner[name] != pool.name:
                raise ConfigError(
                    f"{where}[{i}].models",
                    f"model {name!r} is served by pools {owner[name]!r} and {pool.name!r}",
                )
            owner[name] = pool.name


def parse_pools(doc: Any, origin: str) -> tuple[PoolConfig, ...]:
    try:
        pools = parse(PoolsDocument, doc or {}).pools
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc.path}" if exc.path else origin, exc.message) from exc
    check_unique(pools, f"{origin}: pools")
    return pools


def load_pools(path: Path) -> tuple[PoolConfig, ...]:
    try:
        text = path.read_text()
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read: {exc.strerror or exc}") from exc
    except (yaml.YAMLError, ValueError) as exc:
        raise ConfigError(str(path), f"not YAML/JSON: {exc}") from exc
    return tuple(_beside(pool, path.parent) for pool in parse_pools(doc, str(path)))


def _beside(pool: PoolConfig, directory: Path) -> PoolConfig:
    """A relative engines' key file is the pools file's neighbour (the operator mounts both
    from one Secret)."""
    key = pool.backends.engine_api_key_file
    if key is None or Path(key).is_absolute():
        return pool
    backends = replace(pool.backends, engine_api_key_file=str(directory / key))
    return replace(pool, backends=backends)
