"""The simulator's LoRA model: SGLang's --lora-paths forms, an adapter's size, the registry."""

from __future__ import annotations

import pytest

from kvfleet_sim.catalog import BUILTIN
from kvfleet_sim.lora import (
    AdapterRef,
    LoraConfig,
    Registry,
    adapter_bytes,
    copy_in_seconds,
    parse_lora_path,
)


def test_lora_paths_in_sglangs_three_forms() -> None:
    assert parse_lora_path("/a/sql") == AdapterRef("/a/sql", "/a/sql")
    assert parse_lora_path("sql=/a/sql") == AdapterRef("sql", "/a/sql")
    assert parse_lora_path('{"lora_name": "s", "lora_path": "/a", "pinned": true}') == (
        AdapterRef("s", "/a", pinned=True)
    )
    with pytest.raises(ValueError, match="lora_name and lora_path"):
        parse_lora_path('{"lora_name": "s"}')
    with pytest.raises(ValueError, match="twice"):
        LoraConfig(enabled=True, adapters=(AdapterRef("a", "/x"), AdapterRef("a", "/y")))
    with pytest.raises(ValueError, match="max-loaded-loras"):
        LoraConfig(enabled=True, max_loras_per_batch=8, max_loaded_loras=4)


def test_an_adapters_size_and_copy_in_time() -> None:
    """Rank 16 on every projection of Llama-3.1-8B: 42M parameters, 84 MB in bf16 (as the
    published adapters of that shape weigh); a few milliseconds over PCIe."""
    size = adapter_bytes(BUILTIN.model("llama-3.1-8b"), 16)
    assert size == pytest.approx(83.9e6, rel=0.01)
    assert 0.002 < copy_in_seconds(BUILTIN.model("llama-3.1-8b"), 16) < 0.005


def test_the_registry_refuses_what_sglang_refuses() -> None:
    off = Registry(LoraConfig())
    assert off.load(AdapterRef("a", "/a")) is not None and "--enable-lora" in str(
        off.load(AdapterRef("a", "/a"))
    )
    on = Registry(LoraConfig(enabled=True, max_loras_per_batch=1, max_loaded_loras=1))
    assert on.load(AdapterRef("a", "/a")) is None
    assert "reached (1)" in str(on.load(AdapterRef("b", "/b")))
    assert on.unload("b") is not None and on.unload("a") is None and on.summary() == {}
