"""SGLang's server flags as click options; every default comes from `EngineConfig` (one each)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from kvfleet_sim.catalog import BUILTIN, Catalog, CatalogError, load_catalog_file
from kvfleet_sim.config import (
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    SCHEDULE_POLICIES,
    ConfigError,
    EngineConfig,
)
from kvfleet_sim.costmodel import DEFAULT_PROFILE, PROFILES
from kvfleet_sim.hf_config import load_model_config
from kvfleet_sim.lora import LoraConfig, parse_lora_path
from kvfleet_sim.measured import DEFAULT_TRUTH, TRUTHS

F = TypeVar("F", bound=Callable[..., Any])


def default_of(cls: type, name: str) -> Any:
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    raise KeyError(name)


def engine_options(func: F) -> F:
    """SGLang's server flags (same names) plus the simulator's --gpu/--catalog/--profile."""

    def d(name: str) -> Any:
        return default_of(EngineConfig, name)

    opts = [
        click.option(
            "--model",
            "--model-path",
            "model",
            default=None,
            help="Catalogue model name or Hugging Face id (e.g. llama-3.1-8b), or a model"
            " directory holding a config.json (as SGLang's --model-path).",
        ),
        click.option(
            "--model-config",
            type=click.Path(exists=True, path_type=Path),
            default=None,
            help="A Hugging Face config.json (or its directory): any model, dense, MoE or MLA;"
            " --model then names it.",
        ),
        click.option("--gpu", required=True, help="Catalogue GPU (h100, h200, a100-80g, l40s)."),
        click.option(
            "--tp",
            "--tp-size",
            "tp_size",
            type=int,
            default=d("tp_size"),
            show_default=True,
            help="Tensor-parallel GPUs per replica.",
        ),
        click.option(
            "--quantization",
            type=click.Choice(QUANTIZATIONS),
            default=None,
            help="Default: the checkpoint's (fp8 where its config.json says so), else none.",
        ),
        click.option(
            "--kv-cache-dtype",
            type=click.Choice(KV_CACHE_DTYPES),
            default=d("kv_cache_dtype"),
            show_default=True,
        ),
        click.option(
            "--mem-fraction-static",
            type=float,
            default=None,
            help="Default: SGLang's table by GPU size and TP.",
        ),
        click.option("--context-length", type=int, default=None),
        click.option("--max-running-requests", type=int, default=None),
        click.option("--max-total-tokens", type=int, default=None),
        click.option("--max-queued-requests", type=int, default=None),
        click.option(
            "--chunked-prefill-size",
            type=int,
            default=None,
            help="Default: by GPU memory (8192 on 80-160 GB); -1 disables chunking.",
        ),
        click.option(
            "--max-prefill-tokens", type=int, default=d("max_prefill_tokens"), show_default=True
        ),
        click.option(
            "--schedule-policy",
            type=click.Choice(SCHEDULE_POLICIES),
            default=d("schedule_policy"),
            show_default=True,
        ),
        click.option("--disable-radix-cache", is_flag=True, default=d("disable_radix_cache")),
        click.option("--page-size", type=int, default=d("page_size"), show_default=True),
        click.option(
            "--catalog",
            "catalog_file",
            type=click.Path(exists=True, path_type=Path),
            default=None,
            help="YAML file adding GPUs/models to the catalogue.",
        ),
        click.option(
            "--profile",
            type=click.Choice(sorted(PROFILES)),
            default=DEFAULT_PROFILE,
            show_default=True,
            help="Engine generation whose efficiency the roofline models.",
        ),
        click.option(
            "--cost-model",
            type=click.Choice(TRUTHS),
            default=DEFAULT_TRUTH,
            show_default=True,
            help="Step times: measured GPU timings (vidur's) where the model, GPU and TP were"
            " profiled, else the roofline (auto); or either alone.",
        ),
    ]
    for opt in reversed(opts):
        func = opt(func)
    return func


ENGINE_KEYS = (
    "model",
    "model_config",
    "gpu",
    "tp_size",
    "quantization",
    "kv_cache_dtype",
    "mem_fraction_static",
    "context_length",
    "max_running_requests",
    "max_total_tokens",
    "max_queued_requests",
    "chunked_prefill_size",
    "max_prefill_tokens",
    "schedule_policy",
    "disable_radix_cache",
    "page_size",
    "catalog_file",
)


def load_catalog(catalog_file: Path | None) -> Catalog:
    """The built-in catalogue, extended by `--catalog FILE` (or a clear usage error)."""
    try:
        return load_catalog_file(catalog_file) if catalog_file else BUILTIN
    except CatalogError as exc:
        raise click.UsageError(str(exc)) from exc


def build_engine_config(kw: dict[str, Any], catalog: Catalog | None = None) -> EngineConfig:
    """Pop the engine flags out of `kw` and build the config, or fail with a clear message
    (`catalog`: the one `--catalog` gave, when the caller has read it already)."""
    values = {k: kw.pop(k) for k in ENGINE_KEYS}
    catalog_file = values.pop("catalog_file")
    name, config_file = values.pop("model"), values.pop("model_config")
    if catalog is None:
        catalog = load_catalog(catalog_file)
    try:
        if config_file is not None:
            model = load_model_config(config_file, name)
        elif name is None:
            raise click.UsageError("give --model (a catalogue name) or --model-config")
        elif (Path(name) / "config.json").is_file():
            model = load_model_config(Path(name))
        else:
            model = catalog.model(name)
        return EngineConfig.for_model(model, catalog.gpu(values.pop("gpu")), **values)
    except (CatalogError, ConfigError) as exc:
        raise click.UsageError(str(exc)) from exc


def lora_options(func: F) -> F:
    """SGLang's LoRA flags (`--lora-paths` repeatable here; SGLang takes them space-separated
    after one flag, which the local cluster's kubelet rewrites)."""
    options = [
        click.option("--enable-lora", is_flag=True, default=None, help="Serve LoRA adapters."),
        click.option(
            "--lora-paths",
            multiple=True,
            help="An adapter loaded at start: PATH, NAME=PATH or SGLang's JSON (repeatable).",
        ),
        click.option(
            "--max-loras-per-batch",
            type=int,
            default=default_of(LoraConfig, "max_loras_per_batch"),
            show_default=True,
        ),
        click.option("--max-lora-rank", type=int, default=None),
        click.option("--max-loaded-loras", type=int, default=None),
        click.option("--lora-target-modules", multiple=True, help="Accepted for SGLang parity."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def build_lora_config(kw: dict[str, Any]) -> LoraConfig:
    """Pop the LoRA flags out of `kw` (`--lora-paths` turns LoRA on, as in SGLang)."""
    kw.pop("lora_target_modules")
    paths = kw.pop("lora_paths")
    enabled = kw.pop("enable_lora")
    try:
        return LoraConfig(
            enabled=bool(paths) if enabled is None else enabled,
            adapters=tuple(parse_lora_path(p) for p in paths),
            max_loras_per_batch=kw.pop("max_loras_per_batch"),
            max_lora_rank=kw.pop("max_lora_rank"),
            max_loaded_loras=kw.pop("max_loaded_loras"),
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
