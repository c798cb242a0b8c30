"""Any model from its Hugging Face config.json (tests/data/models/: written from the published
architecture numbers): parameters as published, MoE compute on active parameters and weight
streaming on the experts a batch touches, MLA's compressed KV, FP8 checkpoints, catalogue
entries and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfleet_sim.catalog import BUILTIN, CatalogError, load_catalog_file
from kvfleet_sim.config import EngineConfig, derive_layout
from kvfleet_sim.costmodel import PROFILES, RooflineCostModel, StepShape
from kvfleet_sim.hf_config import load_model_config, model_from_hf_config

MODELS = Path(__file__).resolve().parents[1] / "data" / "models"


@pytest.mark.parametrize(
    ("name", "total_b", "active_b"),
    [
        ("qwen3-32b", 32.8, 32.8),
        ("llama-3.3-70b", 70.6, 70.6),
        ("qwen3-30b-a3b", 30.5, 3.3),  # "30.5B total, 3.3B activated"
        ("deepseek-v3", 671.0, 37.0),  # "671B total, 37B activated" (MTP module excluded)
    ],
)
def test_parameters_match_the_published_counts(name: str, total_b: float, active_b: float) -> None:
    m = load_model_config(MODELS / name)
    assert m.num_params / 1e9 == pytest.approx(total_b, rel=0.01)
    active = m.active_body_params + m.embedding_params + m.lm_head_params
    assert active / 1e9 == pytest.approx(active_b, rel=0.03)


def test_mla_stores_its_compressed_kv_on_every_rank() -> None:
    ds = load_model_config(MODELS / "deepseek-v3")
    assert (ds.kv_lora_rank, ds.qk_rope_head_dim, ds.dense_layers) == (512, 64, 3)
    assert ds.checkpoint_quantization == "fp8"  # its config.json's quantization_config
    config = EngineConfig(model=ds, gpu=BUILTIN.gpu("h200"), tp_size=8, quantization="fp8")
    layout = derive_layout(config)
    assert layout.kv_bytes_per_token_per_gpu == 61 * (512 + 64) * 2
    llama = load_model_config(MODELS / "llama-3.3-70b")
    layout = derive_layout(EngineConfig(model=llama, gpu=BUILTIN.gpu("h100"), tp_size=4))
    assert layout.kv_bytes_per_token_per_gpu == 2 * 80 * 2 * 128 * 2  # 8 KV heads over 4 ranks


def test_moe_computes_active_parameters_and_reads_the_experts_it_touches() -> None:
    moe = load_model_config(MODELS / "qwen3-30b-a3b")
    cost = RooflineCostModel(
        derive_layout(EngineConfig(model=moe, gpu=BUILTIN.gpu("h100"))), PROFILES["sglang"]
    )
    one = cost.step_cost(StepShape(decode_seqs=1, decode_ctx_tokens=1000))
    many = cost.step_cost(StepShape(decode_seqs=256, decode_ctx_tokens=256_000))
    # One token touches 8 of 128 experts per layer; 256 tokens touch nearly all of them.
    assert moe.experts_touched(1) == pytest.approx(8.0)
    assert moe.experts_touched(256) > 127
    expert_gb = moe.routed_expert_params * 2 / 1e9
    assert expert_gb > 50
    assert many.linear_s > 3 * one.linear_s  # decode at batch 1 streams a fraction of it
    # A dense model of the same total size reads all of its weights even for one token.
    dense = load_model_config(MODELS / "qwen3-32b")
    dense_cost = RooflineCostModel(
        derive_layout(EngineConfig(model=dense, gpu=BUILTIN.gpu("h100"))), PROFILES["sglang"]
    )
    dense_one = dense_cost.step_cost(StepShape(decode_seqs=1, decode_ctx_tokens=1000))
    assert dense_one.linear_s > 5 * one.linear_s


def test_the_stop_token_is_the_models_own() -> None:
    """config.json's eos_token_id (an id or a list) is the simulator's natural stop; the
    catalogue's entries carry their models' own (Mistral's is 2, not Llama-3's 128009)."""
    llama = load_model_config(MODELS / "llama-3.3-70b")
    assert llama.eos_token_ids == (128001, 128008, 128009) and llama.stop_token_id == 128009
    assert load_model_config(MODELS / "qwen3-32b").stop_token_id == 151645
    assert BUILTIN.model("mistral-7b").stop_token_id == 2
    assert BUILTIN.model("deepseek-v3").stop_token_id == 1  # from its config: file
    assert model_from_hf_config({**json.loads((MODELS / "qwen3-32b" / "config.json")
                                              .read_text()), "eos_token_id": None},
                                "x").stop_token_id is None  # fmt: skip


def test_a_user_catalogue_entry_can_point_at_a_config(tmp_path: Path) -> None:
    catalog = tmp_path / "catalog.yaml"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text((MODELS / "qwen3-32b" / "config.json").read_text())
    catalog.write_text(
        "models:\n  my-qwen:\n    config: m/config.json\n    context_length: 32768\n"
    )
    m = load_catalog_file(catalog).model("my-qwen")
    assert (m.name, m.context_length, m.num_layers) == ("my-qwen", 32768, 64)


def test_bad_configs_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="no 'hidden_size'"):
        model_from_hf_config({"num_hidden_layers": 2}, "x", "x/config.json")
    doc = json.loads((MODELS / "qwen3-30b-a3b" / "config.json").read_text())
    with pytest.raises(CatalogError, match=r"num_experts_per_tok must be 1\.\.128"):
        model_from_hf_config({**doc, "num_experts_per_tok": 500}, "x")
    with pytest.raises(CatalogError, match="must be a non-negative number"):
        model_from_hf_config({**doc, "hidden_size": "big"}, "x")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CatalogError, match="not JSON"):
        load_model_config(tmp_path)


def test_the_cli_simulates_any_model_from_its_config() -> None:
    from kvfleet_cli.main import cli

    runner = CliRunner()
    args = ["sim", "offline", "--gpu", "h200", "--tp", "8", "--num-prompts", "200"]
    result = runner.invoke(cli, [*args, "--model-config", str(MODELS / "deepseek-v3")])
    assert result.exit_code == 0, result.output
    assert "output_throughput" in result.output
    # As SGLang's --model-path: a directory holding config.json; fp8 from the checkpoint.
    result = runner.invoke(cli, [*args, "--model", str(MODELS / "deepseek-v3")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, [*args, "--quantization", "none", "--model-config",
                                 str(MODELS / "deepseek-v3")])  # fmt: skip
    assert result.exit_code != 0 and "raise --tp-size" in result.output
