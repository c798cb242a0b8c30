"""A model's architecture from its Hugging Face `config.json`: the one parser of that format.

The gateway reads it for the kvfleet policy's priors (parameters streamed per decode step,
parameters multiplied per prompt token, KV bytes per token); the simulator reads it through
this module too, to build the model it simulates.

Read: layers, hidden size, attention heads, KV heads, head dim, vocabulary, MLP width, context
length, tied embeddings; mixture-of-experts fields under the names the families use
(`num_experts` / `n_routed_experts` / `num_local_experts`, `num_experts_per_tok`,
`n_shared_experts` or Qwen's `shared_expert_intermediate_size`, `moe_intermediate_size`,
`first_k_dense_replace`); FP8 checkpoints (`quantization_config.quant_method`); and
multi-head latent attention (`kv_lora_rank`, `q_lora_rank`, `qk_rope_head_dim`,
`qk_nope_head_dim`, `v_head_dim`). Parameters are counted per layer (attention projections,
gated MLP or experts and router) plus embeddings; norms and biases are left out (well under
0.1%).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
REQUIRED = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


class ModelConfigError(ValueError):
    """A config.json that cannot be read or lacks what a model needs."""


@dataclass(frozen=True, kw_only=True)
class ModelArchitecture:
    """A decoder-only transformer as its config.json describes it."""

    hf_id: str | None
    """`_name_or_path`, when the file says it."""
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
    # Mixture of experts (0: a dense MLP in every layer).
    num_experts: int = 0
    """Routed experts per MoE layer (`num_experts`, `n_routed_experts`, `num_local_experts`)."""
    experts_per_token: int = 0
    """Routed experts each token uses (`num_experts_per_tok`)."""
    shared_experts: int = 0
    """Experts every token uses besides the routed ones (DeepSeek's `n_shared_experts`)."""
    moe_intermediate_size: int = 0
    """MLP width of one expert."""
    dense_layers: int = 0
    """Leading layers with a dense MLP before the MoE ones (`first_k_dense_replace`)."""
    # Multi-head latent attention (0: per-head K and V).
    kv_lora_rank: int = 0
    """Width of MLA's compressed KV (`kv_lora_rank`): what the KV cache stores per token."""
    qk_rope_head_dim: int = 0
    """MLA's decoupled rotary key, stored beside the compressed KV."""
    checkpoint_quantization: str = "none"
    """How the published weights are stored (`fp8` for DeepSeek-V3): the engine's default
    `--quantization`, as SGLang reads the checkpoint's `quantization_config`."""
    eos_token_ids: tuple[int, ...] = ()
    """`eos_token_id` (one id or a list): the tokens that end a generation naturally."""

    @property
    def weight_bytes_per_param(self) -> int:
        return 1 if self.checkpoint_quantization == "fp8" else 2

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token holds across all layers, at 16-bit precision (SGLang's
        default KV dtype is the model's: bf16 even for FP8 checkpoints)."""
        if self.kv_lora_rank:  # MLA stores the compressed KV and the rotary key, once
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * 2
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    @property
    def active_params_per_token(self) -> float:
        """Parameters one token is multiplied by: everything but the input embedding (a
        lookup) and the routed experts it is not sent to."""
        layers = self.num_layers - self.dense_layers if self.num_experts else 0
        unused = layers * (self.num_experts - self.experts_per_token)
        unused_params = unused * 3.0 * self.hidden_size * self.moe_intermediate_size
        embedding = 0.0 if self.tied_embeddings else float(self.vocab_size * self.hidden_size)
        return self.num_params - unused_params - embedding


def _int(doc: Mapping[str, Any], key: str, origin: str, default: int | None = None) -> int:
    value = doc.get(key, default)
    if value is None:
        raise ModelConfigError(f"{origin}: config.json has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ModelConfigError(f"{origin}: {key!r} must be a non-negative number, got {value!r}")
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


def parse_model_config(doc: Any, origin: str) -> ModelArchitecture:
    """The architecture a parsed config.json describes; `origin` names it in errors."""
    if not isinstance(doc, Mapping):
        raise ModelConfigError(f"{origin}: config.json must be a JSON object")
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
        raise ModelConfigError(f"{origin}: num_experts_per_tok must be 1..{experts}")
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
    method = str((doc.get("quantization_config") or {}).get("quant_method", "")).lower()
    return ModelArchitecture(
        hf_id=str(doc["_name_or_path"]) if doc.get("_name_or_path") else None,
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
        checkpoint_quantization="fp8" if method == "fp8" else "none",
        eos_token_ids=_token_ids(doc.get("eos_token_id")),
    )


def _token_ids(value: Any) -> tuple[int, ...]:
    """`eos_token_id` as config.json gives it: an id, a list of ids, or absent."""
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool))


def config_file(path: Path) -> Path:
    """A config.json, or the model directory holding one (what `--model-path` names)."""
    return path / CONFIG_FILE if path.is_dir() else path


def read_model_config(path: Path) -> ModelArchitecture:
    file = config_file(path)
    try:
        doc = json.loads(file.read_text())
    except OSError as exc:
        raise ModelConfigError(f"cannot read {file}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ModelConfigError(f"{file}: not JSON ({exc})") from exc
    return parse_model_config(doc, str(file))
