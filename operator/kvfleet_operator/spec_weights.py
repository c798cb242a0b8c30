"""Where an InferenceService's weights come from — the model's and its LoRA adapters' — as
part of the one typed spec `spec.py` assembles (the CRD schema and the operator both come
from it; field docs become the schema's descriptions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvfleet_gateway.config import ADAPTER_NAME_PATTERN
from kvfleet_kernel.schema import Rule, fld

URI_PATTERN = r"^(s3|gs|https?|oci)://[A-Za-z0-9._~:/?#@!&'()*+,;=%\[\]-]+$"
"""A URI of a scheme the engine image reads, in RFC 3986's characters but '$'."""
TARGET_MODULE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
"""A module name as SGLang matches it (q_proj, all): an identifier, never a flag."""
PARENT_SEGMENT = "(^|/)[.][.](/|$)"
"""A '..' path segment (RE2 and Python alike: no look-around), which climbs out of a mount."""


@dataclass(frozen=True, kw_only=True)
class PvcSource:
    """Weights already on a PersistentVolumeClaim."""

    RULES: ClassVar = (
        Rule(
            f"!has(self.path) || !self.path.matches('{PARENT_SEGMENT}')",
            "path must stay inside the claim: it may not have a '..' segment (the engine "
            "is given the mount's directory joined with it, and '..' leaves the claim)",
            field_path=".path",
        ),
    )
    claim_name: str = fld(
        doc="PVC holding the weights (mounted read-only).",
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        max_length=253,
    )
    path: str = fld(
        "/",
        "Directory of the model inside the claim.",
        pattern=r"^[A-Za-z0-9_./-]*$",
        max_length=1024,
    )


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """Where the weights come from: exactly one of huggingFace, pvc, uri."""

    RULES: ClassVar = (
        Rule(
            "[has(self.huggingFace), has(self.pvc), has(self.uri)].filter(x, x).size() == 1",
            "exactly one of huggingFace, pvc, uri must be set",
        ),
    )
    hugging_face: str | None = fld(
        None,
        "Hugging Face model id, e.g. meta-llama/Llama-3.1-8B-Instruct.",
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*/[A-Za-z0-9_][A-Za-z0-9_.-]*$",
        max_length=96,
    )
    pvc: PvcSource | None = fld(None, "Weights on a PersistentVolumeClaim.")
    uri: str | None = fld(
        None,
        "Weights at a URI the engine image can read (s3://, gs://, https://): RFC 3986"
        " characters but '$' (which the kubelet would expand).",
        pattern=URI_PATTERN,
        max_length=2048,
    )


@dataclass(frozen=True, kw_only=True)
class LoraAdapter:
    name: str = fld(
        doc="The adapter's name: what clients put in `model` (alone or as <model>:<name>).",
        pattern=ADAPTER_NAME_PATTERN,
        max_length=128,
    )
    source: ModelSource = fld(
        doc="Where its weights come from: huggingFace (the engine downloads the repo), pvc"
        " (mounted read-only), or uri."
    )
    preload: bool = fld(
        False,
        "Load it when an engine starts (--lora-paths); otherwise the gateway loads it on a"
        " replica when a request first needs it there.",
    )


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """LoRA adapters on the engines (SGLang's --enable-lora), routed by the gateway to the
    replicas that hold them and loaded on demand."""

    RULES: ClassVar = (
        Rule(
            "(has(self.adapters) && self.adapters.exists(a, has(a.preload) && a.preload))"
            " || (has(self.maxLoraRank) && has(self.targetModules))",
            "with no preloaded adapter SGLang sizes its LoRA buffers from maxLoraRank and"
            " targetModules: set both",
            ".maxLoraRank",
        ),
        Rule(
            "!has(self.maxLoadedLoras) || self.maxLoadedLoras >= self.maxLorasPerBatch",
            "maxLoadedLoras must be at least maxLorasPerBatch",
            ".maxLoadedLoras",
        ),
    )
    adapters: tuple[LoraAdapter, ...] = fld(
        (),
        "The adapters clients may use, each name once.",
        max_items=1000,
        unique_by="name",
    )
    max_loras_per_batch: int = fld(
        8, "Distinct adapters one batch runs (SGLang --max-loras-per-batch).", minimum=1,
        maximum=64,
    )  # fmt: skip
    max_lora_rank: int | None = fld(
        None, "Largest adapter rank to size buffers for (--max-lora-rank).", minimum=1,
        maximum=1024,
    )  # fmt: skip
    max_loaded_loras: int | None = fld(
        None,
        "Adapters one engine holds at once (--max-loaded-loras); the gateway unloads the least"
        " recently used beyond it. Unset: maxLorasPerBatch.",
        minimum=1,
    )
    target_modules: tuple[str, ...] | None = fld(
        None,
        "Modules adapters may target (--lora-target-modules, e.g. q_proj v_proj, or all):"
        " identifiers, each once.",
        max_items=32,
        max_length=64,
        pattern=TARGET_MODULE_PATTERN,
        unique_by=".",
    )
