"""Hardware and model catalogues: the numbers the cost model is built from.

Every entry is a frozen dataclass; the built-ins below cite their public spec sheets and
model configs. More entries can be loaded from a YAML file (`load_catalog_file`) with the
same field names, so a new GPU or model needs no code change.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

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


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, from its Hugging Face `config.json`."""

    name: str
    hf_id: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: float
    """Total parameters, including embeddings and LM head."""
    context_length: int
    tied_embeddings: bool = False

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

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """K and V for every layer: 2 × layers × kv_heads × head_dim × dtype bytes."""
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


# Datasheet figures. Memory is what the driver exposes (80 GB parts show ~79.6 GiB).
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        name="h100",
        memory_bytes=int(79.6 * GIB),
        hbm_bandwidth=3.35e12,
        bf16_flops=989e12,
        fp8_flops=1979e12,
        interconnect_bandwidth=450e9,
        allreduce_latency_s=8e-6,
    ),
    "h200": GpuSpec(
        name="h200",
        memory_bytes=int(139.8 * GIB),
        hbm_bandwidth=4.8e12,
        bf16_flops=989e12,
        fp8_flops=1979e12,
        interconnect_bandwidth=450e9,
        allreduce_latency_s=8e-6,
    ),
    "a100-80g": GpuSpec(
        # No FP8 tensor cores: FP8 weights run through weight-only kernels at the BF16 rate.
        name="a100-80g",
        memory_bytes=int(79.2 * GIB),
        hbm_bandwidth=2.039e12,
        bf16_flops=312e12,
        fp8_flops=312e12,
        interconnect_bandwidth=300e9,
        allreduce_latency_s=10e-6,
    ),
    "l40s": GpuSpec(
        # PCIe Gen4 x16 between cards, no NVLink.
        name="l40s",
        memory_bytes=int(44.4 * GIB),
        hbm_bandwidth=0.864e12,
        bf16_flops=362e12,
        fp8_flops=733e12,
        interconnect_bandwidth=25e9,
        allreduce_latency_s=25e-6,
    ),
}

MODELS: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec(
        name="llama-3.1-8b",
        hf_id="meta-llama/Llama-3.1-8B-Instruct",
        architecture="LlamaForCausalLM",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        num_params=8.03e9,
        context_length=131072,
    ),
    "llama-3.1-70b": ModelSpec(
        name="llama-3.1-70b",
        hf_id="meta-llama/Llama-3.1-70B-Instruct",
        architecture="LlamaForCausalLM",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
        num_params=70.6e9,
        context_length=131072,
    ),
    "mistral-7b": ModelSpec(
        name="mistral-7b",
        hf_id="mistralai/Mistral-7B-Instruct-v0.3",
        architecture="MistralForCausalLM",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=32768,
        num_params=7.25e9,
        context_length=32768,
    ),
    "qwen2.5-72b": ModelSpec(
        name="qwen2.5-72b",
        hf_id="Qwen/Qwen2.5-72B-Instruct",
        architecture="Qwen2ForCausalLM",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=29568,
        vocab_size=152064,
        num_params=72.7e9,
        context_length=32768,
    ),
}

# Aliases people type; the served name of a Hugging Face id maps to the catalogue entry.
ALIASES: dict[str, str] = {
    "a100": "a100-80g",
    "llama-3-8b": "llama-3.1-8b",
    **{m.hf_id.lower(): key for key, m in MODELS.items()},
    "meta-llama/meta-llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/meta-llama-3-8b-instruct": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-70b-instruct": "llama-3.1-70b",
}


class CatalogError(ValueError):
    """An unknown name or a malformed catalogue file."""


@dataclass(frozen=True)
class Catalog:
    gpus: Mapping[str, GpuSpec]
    models: Mapping[str, ModelSpec]

    def gpu(self, name: str) -> GpuSpec:
        key = ALIASES.get(name.lower(), name.lower())
        if key not in self.gpus:
            raise CatalogError(f"unknown GPU {name!r}; known: {', '.join(sorted(self.gpus))}")
        return self.gpus[key]

    def model(self, name: str) -> ModelSpec:
        key = ALIASES.get(name.lower(), name.lower())
        if key not in self.models:
            raise CatalogError(f"unknown model {name!r}; known: {', '.join(sorted(self.models))}")
        return self.models[key]

    def extended(self, gpus: Mapping[str, GpuSpec], models: Mapping[str, ModelSpec]) -> Catalog:
        return Catalog(gpus={**self.gpus, **gpus}, models={**self.models, **models})


BUILTIN = Catalog(gpus=GPUS, models=MODELS)


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


def load_catalog_file(path: Path, base: Catalog = BUILTIN) -> Catalog:
    """Extend `base` with `gpus:` and `models:` mappings from a YAML file (fields as above)."""
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise CatalogError(f"cannot read catalogue {path}: {exc}") from exc
    if not isinstance(doc, dict):
        raise CatalogError(f"{path}: expected a mapping with 'gpus' and/or 'models'")
    gpus = {k: _build(GpuSpec, k, v) for k, v in (doc.get("gpus") or {}).items()}
    models = {k: _build(ModelSpec, k, v) for k, v in (doc.get("models") or {}).items()}
    return base.extended(gpus, models)
