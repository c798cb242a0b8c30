"""LoRA adapters as SGLang 0.5.23 serves them: flags, the adapter registry, its endpoints'
fields, and what adapters cost a batch.

* **Flags**: `--enable-lora`, `--lora-paths` (each `PATH`, `NAME=PATH`, or the JSON
  `{"lora_name", "lora_path", "pinned"}`), `--max-loras-per-batch` (8), `--max-lora-rank`,
  `--max-loaded-loras`, `--lora-target-modules`.
* **Endpoints**: `POST /load_lora_adapter {lora_name, lora_path, pinned}` and `POST
  /unload_lora_adapter {lora_name}` answer `{success, error_message, loaded_adapters}` (400
  when `success` is false); `/v1/models` lists each loaded adapter as a model whose `parent`
  is the served model. A request names its adapter as `model: "<served>:<adapter>"` or with
  `lora_path: "<adapter>"`; an adapter that is not loaded is a 400.
* **Batches**: a batch runs at most `--max-loras-per-batch` distinct adapters; a waiting
  request whose adapter would exceed that is skipped (SGLang's `can_schedule_lora_req`), the
  next one that fits goes. An adapter that joins a batch and is not in the GPU pool (as many
  slots as adapters per batch, least recently used evicted) is copied in first.

What is simulated is the timing: loading an adapter reads its weights from disk, a new adapter
in the GPU pool costs their host-to-device copy, and each distinct adapter in a batch slows
its step (the segmented GEMMs of S-LoRA/Punica: `MIX_COST` per adapter, a stand-in, not fitted
to a measurement). There are no weights; any path loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvfleet_sim.catalog import ModelSpec

DEFAULT_RANK = 16
"""The rank adapters are sized at unless `--max-lora-rank` says more (a common fine-tune)."""
DISK_BANDWIDTH = 2.0e9
"""Bytes/s an adapter's weights are read at by /load_lora_adapter (local NVMe or page cache)."""
LOAD_OVERHEAD_S = 0.05
"""Per load: opening the files, building the adapter's modules."""
H2D_BANDWIDTH = 2.5e10
"""Bytes/s of the host-to-device copy into the GPU adapter pool (PCIe Gen5 x16, effective)."""
MIX_COST = 0.03
"""A step's time grows by this share per distinct adapter beyond the first (SGMV segments)."""


@dataclass(frozen=True)
class AdapterRef:
    name: str
    path: str
    pinned: bool = False


@dataclass(frozen=True)
class LoraConfig:
    enabled: bool = False
    adapters: tuple[AdapterRef, ...] = ()
    """`--lora-paths`: loaded at start."""
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None
    max_loaded_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras_per_batch < 1:
            raise ValueError("--max-loras-per-batch must be positive")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError("--max-loaded-loras must be >= --max-loras-per-batch")
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError("--lora-paths names an adapter twice")

    @property
    def rank(self) -> int:
        return self.max_lora_rank or DEFAULT_RANK


def parse_lora_path(value: str) -> AdapterRef:
    """One `--lora-paths` item: `PATH`, `NAME=PATH`, or SGLang's JSON form."""
    if value.lstrip().startswith("{"):
        try:
            doc = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-paths: invalid JSON {value!r}: {exc}") from exc
        if not isinstance(doc, dict) or not {"lora_name", "lora_path"} <= set(doc):
            raise ValueError("--lora-paths JSON needs lora_name and lora_path")
        return AdapterRef(str(doc["lora_name"]), str(doc["lora_path"]), bool(doc.get("pinned")))
    name, _, path = value.partition("=")
    return AdapterRef(name, path) if path else AdapterRef(value, value)


def adapter_bytes(model: ModelSpec, rank: int) -> float:
    """Weights of one adapter on the attention and MLP projections of every layer (A and B
    of rank `rank`, bf16)."""
    h, kv = model.hidden_size, model.num_kv_heads * model.head_dim
    q = model.num_heads * model.head_dim
    i = model.intermediate_size
    per_layer = (h + q) + (h + kv) * 2 + (q + h) + (h + i) * 2 + (i + h)
    return float(per_layer * rank * model.num_layers * 2)


def load_seconds(model: ModelSpec, rank: int) -> float:
    return LOAD_OVERHEAD_S + adapter_bytes(model, rank) / DISK_BANDWIDTH


def copy_in_seconds(model: ModelSpec, rank: int) -> float:
    return adapter_bytes(model, rank) / H2D_BANDWIDTH


class Registry:
    """The adapters a server holds (SGLang's `lora_registry`): name → reference."""

    def __init__(self, config: LoraConfig) -> None:
        self.config = config
        self.loaded: dict[str, AdapterRef] = {a.name: a for a in config.adapters}

    def load(self, ref: AdapterRef) -> str | None:
        """An error message, or None when loaded."""
        if not self.config.enabled:
            return "LoRA is not enabled: start the server with --enable-lora"
        if not ref.name or not ref.path:
            return "lora_name and lora_path are required"
        if ref.name in self.loaded:
            return f"The LoRA adapter {ref.name!r} is already loaded"
        cap = self.config.max_loaded_loras
        if cap is not None and len(self.loaded) >= cap:
            return f"Maximum number of loaded LoRA adapters reached ({cap}): unload one first"
        self.loaded[ref.name] = ref
        return None

    def unload(self, name: str) -> str | None:
        if name not in self.loaded:
            return f"The LoRA adapter {name!r} is not loaded"
        del self.loaded[name]
        return None

    def summary(self) -> dict[str, str]:
        return {n: a.path for n, a in self.loaded.items()}
