"""Hardware and model catalogues: the numbers the cost model is built from.

Every entry is a frozen dataclass (GPUs, models, and the links a prefill engine's KV crosses
to its decode engine); the built-ins in data/catalog.yaml cite their public spec sheets and
model configs. More entries can be loaded from a YAML file (`load_catalog_file`) with the
same field names, so a new GPU or model needs no code change.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kvfleet_gateway.model_config import ModelArchitecture

GIB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator, as its datasheet states it (peak numbers, dense)."""

    name: str
    memory_bytes: int
    """HBM capacity usable by the framework (what `torch.cuda.mem_get_info` reports)."""
    hbm_bandwidth: float
    """Peak HBM bandwidth, bytes/s."""
    bf16_flops: float
    """Peak dense BF16 tensor-core FLOP/s (no sparsity)."""
    fp8_flops: float
    """Peak dense FP8 FLOP/s; equals bf16_flops on GPUs without FP8 tensor cores."""
    interconnect_bandwidth: float
    """Per-GPU one-direction bandwidth between tensor-parallel peers (NVLink or PCIe), bytes/s."""
    allreduce_latency_s: float
    """Fixed cost of one small all-reduce between TP peers (launch + sync), seconds."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec(ModelArchitecture):
    """A decoder-only transformer, from its Hugging Face `config.json` (the architecture the
    product's parser reads), under the name clients call it."""

    name: str
    hf_id: str

    @property
    def stop_token_id(self) -> int | None:
        """The token a natural end of generation reports (SGLang's `matched_stop`): the
        last of `eos_token_id` — Llama-3 lists <|eot_id|>, which ends a chat turn, last."""
        return self.eos_token_ids[-1] if self.eos_token_ids else None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers if self.is_moe else 0

    @property
    def expert_params(self) -> float:
        """Parameters of one routed expert (gated MLP: gate, up, down)."""
        return 3.0 * self.hidden_size * self.moe_intermediate_size

    @property
    def routed_expert_params(self) -> float:
        """All routed experts of all MoE layers: weights a step reads only where routed."""
        return self.moe_layers * self.num_experts * self.expert_params

    @property
    def active_body_params(self) -> float:
        """Parameters one token is multiplied by: the body less the experts it is not
        routed to (= body_params for a dense model)."""
        unused = self.moe_layers * (self.num_experts - self.experts_per_token) * self.expert_params
        return self.body_params - unused

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct routed experts per MoE layer that `tokens` tokens use, with
        uniform routing: E·(1 − (1 − k/E)^tokens)."""
        if not self.is_moe or tokens <= 0:
            return 0.0
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens)

    @property
    def embedding_params(self) -> float:
        """Parameters of the input embedding (a lookup: no FLOPs)."""
        return float(self.vocab_size * self.hidden_size)

    @property
    def lm_head_params(self) -> float:
        return float(self.vocab_size * self.hidden_size)

    @property
    def body_params(self) -> float:
        """Parameters multiplied once per token: everything but the embedding and LM head."""
        heads = 1 if self.tied_embeddings else 2
        return self.num_params - heads * self.embedding_params


# Aliases people type; the served name of a Hugging Face id maps to the catalogue entry.
ALIASES: dict[str, str] = {
    "a100": "a100-80g",
    "llama-3-8b": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/meta-llama-3-8b-instruct": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-70b-instruct": "llama-3.1-70b",
    # NVIDIA GPU feature discovery's `nvidia.com/gpu.product` node labels
    "nvidia-h100-80gb-hbm3": "h100",
    "nvidia-h200": "h200",
    "nvidia-a100-sxm4-80gb": "a100-80g",
    "nvidia-l40s": "l40s",
}


@dataclass(frozen=True)
class LinkSpec:
    """A path between a prefill engine's GPUs and a decode engine's (disaggregated serving)."""

    name: str
    bandwidth: float
    """Bytes/s per GPU, one direction: each GPU sends its shard of the KV over its own path."""
    setup_latency_s: float = 0.002
    """Per hand-off: the decode side's bootstrap query and the transfer's registration."""


class CatalogError(ValueError):
    """An unknown name or a malformed catalogue file."""


@dataclass(frozen=True)
class Catalog:
    gpus: Mapping[str, GpuSpec]
    models: Mapping[str, ModelSpec]
    links: Mapping[str, LinkSpec] = field(default_factory=dict)

    def _key(self, name: str) -> str:
        low = name.lower()
        by_hf = {m.hf_id.lower(): k for k, m in self.models.items()}
        return ALIASES.get(low) or by_hf.get(low) or low

    def gpu(self, name: str) -> GpuSpec:
        key = self._key(name)
        if key not in self.gpus:
            raise CatalogError(f"unknown GPU {name!r}; known: {', '.join(sorted(self.gpus))}")
        return self.gpus[key]

    def model(self, name: str) -> ModelSpec:
        key = self._key(name)
        if key not in self.models:
            raise CatalogError(f"unknown model {name!r}; known: {', '.join(sorted(self.models))}")
        return self.models[key]

    def link(self, name: str) -> LinkSpec:
        if name.lower() not in self.links:
            raise CatalogError(f"unknown link {name!r}; known: {', '.join(sorted(self.links))}")
        return self.links[name.lower()]

    def extended(self, gpus: Mapping[str, GpuSpec], models: Mapping[str, ModelSpec],
                 links: Mapping[str, LinkSpec] | None = None) -> Catalog:  # fmt: skip
        return Catalog({**self.gpus, **gpus}, {**self.models, **models},
                       {**self.links, **(links or {})})  # fmt: skip


def _coerce(cls: type[Any], name: str, key: str, value: Any, kind: Any) -> Any:
    """YAML 1.1 reads `8.0e12` as a string: convert numbers explicitly, and say what is wrong."""
    try:
        if kind is bool:
            if not isinstance(value, bool):
                raise ValueError
            return value
        if kind is int:
            return int(float(value)) if isinstance(value, str) else int(value)
        if kind is float:
            return float(value)
        if typing.get_origin(kind) is tuple:  # token ids: one, or a list
            return tuple(int(v) for v in (value if isinstance(value, list | tuple) else [value]))
        return str(value)
    except (TypeError, ValueError):
        raise CatalogError(
            f"{cls.__name__} {name!r}: field {key!r} must be {kind.__name__}, got {value!r}"
        ) from None


def _build(cls: type[Any], name: str, fields: Any) -> Any:
    if not isinstance(fields, Mapping):
        raise CatalogError(f"{cls.__name__} {name!r}: expected a mapping of fields")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(fields) - known
    if unknown:
        raise CatalogError(f"{cls.__name__} {name!r}: unknown fields {sorted(unknown)}")
    values = {k: _coerce(cls, name, k, v, hints[k]) for k, v in fields.items() if k != "name"}
    try:
        return cls(name=name, **values)
    except TypeError as exc:
        raise CatalogError(f"{cls.__name__} {name!r}: {exc}") from exc


def parse_catalog(text: str, base: Catalog, origin: str) -> Catalog:
    """Extend `base` with the `gpus:`, `models:` and `links:` mappings of a YAML document."""
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise CatalogError(f"cannot parse catalogue {origin}: {exc}") from exc
    if not isinstance(doc, dict) or set(doc) - {"gpus", "models", "links"}:
        raise CatalogError(f"{origin}: expected a mapping of 'gpus', 'models' and/or 'links'")
    gpus = {k: _build(GpuSpec, k, v) for k, v in (doc.get("gpus") or {}).items()}
    links = {str(k).lower(): _build(LinkSpec, str(k).lower(), v)
             for k, v in (doc.get("links") or {}).items()}  # fmt: skip
    models = {
        k: _from_config(k, v, origin) if isinstance(v, Mapping) and "config" in v
        else _build(ModelSpec, k, v)
        for k, v in (doc.get("models") or {}).items()
    }  # fmt: skip
    return base.extended(gpus, models, links)


def _from_config(name: str, fields: Mapping[str, Any], origin: str) -> ModelSpec:
    """`config: path/to/config.json` (relative to the catalogue file), plus overrides."""
    from kvfleet_sim.hf_config import load_model_config

    path = Path(str(fields["config"]))
    if not path.is_absolute():
        path = Path(origin).parent / path
    spec = load_model_config(path, name)
    overrides = {k: v for k, v in fields.items() if k != "config"}
    if not overrides:
        return spec
    base = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    return typing.cast(ModelSpec, _build(ModelSpec, name, {**base, **overrides}))


def load_catalog_file(path: Path, base: Catalog | None = None) -> Catalog:
    """The built-in catalogue (or `base`) extended by a user's YAML file of the same shape."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise CatalogError(f"cannot read catalogue {path}: {exc}") from exc
    return parse_catalog(text, BUILTIN if base is None else base, str(path))


# The built-ins live in data/catalog.yaml, read through the same parser as user files (its
# `config:` paths relative to it, as a user file's are).
_BUILTIN_FILE = resources.files("kvfleet_sim").joinpath("data/catalog.yaml")
BUILTIN = parse_catalog(_BUILTIN_FILE.read_text(), Catalog(gpus={}, models={}), str(_BUILTIN_FILE))
