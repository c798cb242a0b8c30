"""Catalogue and start-up arithmetic: what SGLang would derive for each deployment."""

from pathlib import Path

import pytest

from kvfleet_sim.catalog import BUILTIN, GIB, CatalogError, load_catalog_file
from kvfleet_sim.config import ConfigError, EngineConfig, derive_layout


def layout(model: str, gpu: str, **kw: object):  # type: ignore[no-untyped-def]
    return derive_layout(EngineConfig(model=BUILTIN.model(model), gpu=BUILTIN.gpu(gpu), **kw))


def test_llama_8b_kv_is_128_kib_per_token() -> None:
    lay = layout("llama-3.1-8b", "h100")
    # Llama-3.1-8B bf16: 32 layers × 8 KV heads × 128 dims × 2 (K and V) × 2 bytes
    assert lay.kv_bytes_per_token_per_gpu == 128 * 1024


def test_pool_size_follows_mem_fraction_minus_weights() -> None:
    lay = layout("llama-3.1-8b", "h100")
    expected = (79.6 * GIB * 0.88 - lay.weight_bytes_per_gpu) / (128 * 1024)
    assert lay.max_total_num_tokens == pytest.approx(expected, abs=1)
    assert 400_000 < lay.max_total_num_tokens < 500_000
    assert lay.chunked_prefill_size == 8192


def test_tensor_parallel_splits_weights_and_kv() -> None:
    one = layout("llama-3.1-70b", "h200", tp_size=2)
    four = layout("llama-3.1-70b", "h200", tp_size=4)
    assert four.weight_bytes_per_gpu == pytest.approx(one.weight_bytes_per_gpu / 2)
    assert four.kv_bytes_per_token_per_gpu == one.kv_bytes_per_token_per_gpu / 2
    # KV heads (8) replicate once tp exceeds them: tp=8 keeps one head per GPU.
    eight = layout("llama-3.1-70b", "h200", tp_size=8)
    assert eight.kv_bytes_per_token_per_gpu == 2 * 80 * 1 * 128 * 2


def test_fp8_halves_linear_weights_and_kv() -> None:
    bf16 = layout("llama-3.1-8b", "h100")
    fp8 = layout("llama-3.1-8b", "h100", quantization="fp8", kv_cache_dtype="fp8_e4m3")
    assert fp8.kv_bytes_per_token_per_gpu == bf16.kv_bytes_per_token_per_gpu / 2
    # embeddings and LM head stay bf16, so a bit more than half
    assert 0.5 < fp8.weight_bytes_per_gpu / bf16.weight_bytes_per_gpu < 0.6


def test_model_that_does_not_fit_is_refused_with_advice() -> None:
    with pytest.raises(ConfigError, match="raise --tp-size"):
        layout("llama-3.1-70b", "h100")


@pytest.mark.parametrize(
    "bad", [{"tp_size": 3}, {"quantization": "awq"}, {"mem_fraction_static": 1.5}, {"page_size": 0}]
)
def test_invalid_configs_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        layout("llama-3.1-8b", "h100", **bad)


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(CatalogError, match="h100"):
        BUILTIN.gpu("tpu-v5")
    assert BUILTIN.model("meta-llama/Llama-3.1-8B-Instruct").name == "llama-3.1-8b"


def test_catalogue_extends_from_yaml(tmp_path: Path) -> None:
    f = tmp_path / "cat.yaml"
    f.write_text(
        "gpus:\n  b200:\n    memory_bytes: 191000000000\n    hbm_bandwidth: 8.0e12\n"
        "    bf16_flops: 2.25e15\n    fp8_flops: 4.5e15\n    interconnect_bandwidth: 9.0e11\n"
        "    allreduce_latency_s: 6.0e-6\n"
    )
    cat = load_catalog_file(f)
    assert cat.gpu("b200").hbm_bandwidth == 8.0e12
    assert cat.gpu("h100") is BUILTIN.gpu("h100")
    f.write_text("gpus:\n  x:\n    memory: 1\n")
    with pytest.raises(CatalogError, match="unknown fields"):
        load_catalog_file(f)


def test_the_links_a_kv_transfer_crosses_are_catalogue_entries(tmp_path: Path) -> None:
    """The built-in links, and a user's own (`links:` in --catalog): the transfer time of a
    disaggregated request is its KV bytes per GPU over the link's per-GPU bandwidth."""
    from click.testing import CliRunner

    from kvfleet_cli.main import cli
    from kvfleet_sim.disaggregation import transfer_seconds

    assert sorted(BUILTIN.links) == ["eth100", "ib400", "nvlink", "roce200"]
    user = tmp_path / "links.yaml"
    user.write_text("links:\n  XDR800:\n    bandwidth: 1.0e+11\n    setup_latency_s: 0.001\n")
    catalog = load_catalog_file(user)
    xdr = catalog.link("xdr800")
    assert catalog.link("ib400") == BUILTIN.link("ib400")  # the built-ins stay
    assert transfer_seconds(8192, 128 * 1024, xdr) == pytest.approx(0.001 + 8192 * 131072 / 1e11)
    assert transfer_seconds(8192, 128 * 1024, xdr) < transfer_seconds(
        8192, 128 * 1024, BUILTIN.link("eth100")
    )
    user.write_text("links:\n  slow:\n    gbps: 10\n")
    with pytest.raises(CatalogError, match="unknown fields \\['gbps'\\]"):
        load_catalog_file(user)
    argv = ["sim", "serve", "--model", "llama-3.1-8b", "--gpu", "h100",
            "--disaggregation-mode", "decode", "--disaggregation-link", "warp9"]  # fmt: skip
    refused = CliRunner().invoke(cli, argv)
    assert refused.exit_code == 2
    assert "unknown link 'warp9'; known: eth100, ib400, nvlink, roce200" in refused.output
