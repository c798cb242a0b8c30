"""Any model, from its Hugging Face `config.json`: the product's parser
(`kvfleet_gateway.model_config`, which the gateway reads for its routing priors) made into
the simulator's `ModelSpec`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvfleet_gateway.model_config import (
    ModelArchitecture,
    ModelConfigError,
    config_file,
    parse_model_config,
    read_model_config,
)
from kvfleet_sim.catalog import CatalogError, ModelSpec


def _spec(arch: ModelArchitecture, name: str) -> ModelSpec:
    fields = {f.name: getattr(arch, f.name) for f in dataclasses.fields(arch)}
    fields["hf_id"] = arch.hf_id or name
    return ModelSpec(name=name, **fields)


def model_from_hf_config(doc: Mapping[str, Any], name: str, origin: str = "") -> ModelSpec:
    """A `ModelSpec` from a parsed config.json; `name` is what clients will call it."""
    try:
        return _spec(parse_model_config(doc, origin or name), name)
    except ModelConfigError as exc:
        raise CatalogError(str(exc)) from None


def load_model_config(path: Path, name: str | None = None) -> ModelSpec:
    """A config.json, or a model directory holding one (what `--model-path` names)."""
    try:
        arch = read_model_config(path)
    except ModelConfigError as exc:
        raise CatalogError(str(exc)) from None
    default = path.name if path.is_dir() else config_file(path).parent.name or path.stem
    return _spec(arch, name or default)
