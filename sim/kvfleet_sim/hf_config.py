"""Any model, from its Hugging Face `config.json`: the architecture numbers the cost model
needs, and the parameter count computed from them.

Read: layers, hidden size, attention heads, KV heads, head dim, vocabulary, MLP width, context
length, tied embeddings; mixture-of-experts fields under the names the families use
(`num_experts` / `n_routed_experts` / `num_local_experts`, `num_experts_per_tok`,
`n_shared_experts` or Qwen's `shared_expert_intermediate_size`, `moe_intermediate_size`,
`first_k_dense_replace`); FP8 checkpoints (`quantization_config.quant_method`); and
multi-head latent attention (`kv_lora_rank`, `q_lora_rank`,
`qk_rope_head_dim`, `qk_nope_head_dim`, `v_head_dim`). Parameters are counted per layer
(attention projections, gated MLP or experts and router) plus embeddings; norms and biases are
left out (well under 0.1%).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvfleet_sim.catalog import CatalogError, ModelSpec

REQUIRED = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


def _int(doc: Mapping[str, Any], key: str, origin: str, default: int | None = None) -> int:
    value = doc.get(key, default)
    if value is None:
        raise CatalogError(f"{origin}: config.json has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise CatalogError(f"{origin}: {key!r} must be a non-negative number, got {value!r}")
    return int(value)


def _attention_params(doc: Mapping[str, Any], h: int, heads: int, kv_heads: int, hd: int) -> int:
    if doc.get("kv_lora_rank"):
        kv_lora, rope = int(doc["kv_lora_rank"]), int(doc.get("qk_rope_head_dim") or 0)
        nope = int(doc.get("qk_nope_head_dim") or hd)
        v = int(doc.get("v_head_dim") or nope)
        q_lora = int(doc.get("q_lora_rank") or 0)
        q = h * q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
        kv = h * (kv_lora + rope) + kv_lora * heads * (nope + v)
        return q + kv + heads * v * h
    return h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h


def model_from_hf_config(doc: Mapping[str, Any], name: str, origin: str = "") -> ModelSpec:
    """A `ModelSpec` from a parsed config.json; `name` is what clients will call it."""
    origin = origin or name
    if not isinstance(doc, Mapping):
        raise CatalogError(f"{origin}: config.json must be a JSON object")
    if isinstance(doc.get("text_config"), Mapping):  # multimodal wrappers keep the LM here
        doc = {**doc, **doc["text_config"]}
    layers, h, heads, inter, vocab = (_int(doc, k, origin) for k in REQUIRED)
    kv_heads = _int(doc, "num_key_value_heads", origin, heads)
    hd = _int(doc, "head_dim", origin, h // heads if heads else 0)
    experts = int(
        doc.get("num_experts") or doc.get("n_routed_experts") or doc.get("num_local_experts") or 0
    )
    per_token = _int(doc, "num_experts_per_tok", origin, 2 if experts else 0) if experts else 0
    moe_inter = _int(doc, "moe_intermediate_size", origin, inter) if experts else 0
    shared = int(doc.get("n_shared_experts") or 0)
    if not shared and doc.get("shared_expert_intermediate_size") and moe_inter:
        shared = round(int(doc["shared_expert_intermediate_size"]) / moe_inter)
    dense_layers = int(doc.get("first_k_dense_replace") or 0) if experts else 0
    if experts and not 0 < per_token <= experts:
        raise CatalogError(f"{origin}: num_experts_per_tok must be 1..{experts}")
    attention = _attention_params(doc, h, heads, kv_heads, hd)
    dense_mlp = 3 * h * inter
    if experts:
        moe_mlp = (experts + shared) * 3 * h * moe_inter + h * experts  # + the router
        body = layers * attention + dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp
    else:
        body = layers * (attention + dense_mlp)
    tied = bool(doc.get("tie_word_embeddings", False))
    kv_lora = int(doc.get("kv_lora_rank") or 0)
    rope = int(doc.get("qk_rope_head_dim") or 0) if kv_lora else 0
    if kv_lora:  # MLA's per-head query/key width
        hd = int(doc.get("qk_nope_head_dim") or hd) + rope
    archs = doc.get("architectures") or ["unknown"]
    return ModelSpec(
        name=name,
        hf_id=str(doc.get("_name_or_path") or name),
        architecture=str(archs[0]),
        num_layers=layers,
        hidden_size=h,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hd,
        intermediate_size=inter,
        vocab_size=vocab,
        num_params=float(body + vocab * h * (1 if tied else 2)),
        context_length=_int(doc, "max_position_embeddings", origin, 4096),
        tied_embeddings=tied,
        num_experts=experts,
        experts_per_token=per_token,
        shared_experts=shared,
        moe_intermediate_size=moe_inter,
        dense_layers=dense_layers,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope,
        checkpoint_quantization=_checkpoint_quantization(doc),
    )


def _checkpoint_quantization(doc: Mapping[str, Any]) -> str:
    method = str((doc.get("quantization_config") or {}).get("quant_method", "")).lower()
    return "fp8" if method == "fp8" else "none"


def load_model_config(path: Path, name: str | None = None) -> ModelSpec:
    """A config.json, or a model directory holding one (what `--model-path` names)."""
    file = path / "config.json" if path.is_dir() else path
    try:
        doc = json.loads(file.read_text())
    except OSError as exc:
        raise CatalogError(f"cannot read {file}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise CatalogError(f"{file}: not JSON ({exc})") from exc
    default = path.name if path.is_dir() else path.parent.name or path.stem
    return model_from_hf_config(doc, name or default, str(file))
