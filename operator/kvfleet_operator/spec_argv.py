"""What an InferenceService may put on the engine's command line and environment: the flags
the operator manages (and their abbreviations, which SGLang's argparse accepts), the flags no
spec may set, the variables the operator sets, and the patterns of every value rendered into
argv, so that no field a spec author writes becomes a flag, an override or an expansion."""

from __future__ import annotations

import re
from typing import Any

MANAGED_FLAGS = (
    "model-path",
    "model",
    "served-model-name",
    "host",
    "port",
    "tp-size",
    "enable-metrics",
    "mem-fraction-static",
    "context-length",
    "max-running-requests",
    "chunked-prefill-size",
    "schedule-policy",
    "disable-radix-cache",
    "quantization",
    "kv-cache-dtype",
    "revision",
    "trust-remote-code",
    "download-dir",
    "api-key",
    "speculative-algorithm",
    "speculative-draft-model-path",
    "speculative-num-steps",
    "speculative-eagle-topk",
    "speculative-num-draft-tokens",
    "page-size",
    "kv-events-config",
    "nnodes",
    "node-rank",
    "disaggregation-mode",
    "disaggregation-transfer-backend",
    "disaggregation-bootstrap-port",
    "disaggregation-ib-device",
    "dist-init-addr",
    "nccl-init-addr",
    "pp-size",
    "pipeline-parallel-size",
    "enable-lora",
    "max-loras-per-batch",
    "max-lora-rank",
    "max-loaded-loras",
    "lora-target-modules",
    "lora-paths",
)
"""SGLang flags the operator sets from the spec; `engine.extraArgs` may not repeat them."""
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"
"""A name clients send in `model` (served name or alias): no ':', which separates a base
model from an adapter (`<model>:<adapter>`), so no name can stand for another service's
adapter on a shared gateway; adapters' names follow ADAPTER_NAME_PATTERN (no '/' either)."""
MODEL_NAME_MAX = 128
GIT_REF_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._/-]*$"
"""A revision: a branch, tag or commit as git names them (never a flag: no leading '-')."""
PATH_PATTERN = r"^[A-Za-z0-9_./][A-Za-z0-9._/-]*$"
"""A Hugging Face id or a path inside the image or a volume (never a flag, no '$', '=')."""
OPERATOR_ENV = (
    "KVFLEET_ENGINE_API_KEY",
    "HF_HOME",
    "HF_TOKEN",
    "LWS_LEADER_ADDRESS",
    "LWS_WORKER_INDEX",
)
"""Environment variables the operator (or LeaderWorkerSet) sets in engine pods and their
command line reads (`$(KVFLEET_ENGINE_API_KEY)`): `engine.env` may not set them, or the
last entry, the user's, would win."""
OPERATOR_ENV_LIST = "[" + ", ".join(f"'{n}'" for n in OPERATOR_ENV) + "]"


FORBIDDEN_FLAGS = (
    "tensor-parallel-size",  # --tp-size's alias
    "config",  # a YAML file of flags, read over the command line's
    "enable-custom-logit-processor",  # runs code a request sends (pickled)
)
"""SGLang flags no InferenceService may set at all."""


def _prefixes_regex(words: tuple[str, ...]) -> str:
    """A regex matching every non-empty prefix of any of `words`, as a compact trie. The
    words are flag names (letters, digits, '-'), written unescaped: the regex goes into a CEL
    string literal, where `\\-` is not a valid escape for the API server's parser."""
    assert all(re.fullmatch("[a-z0-9-]+", w) for w in words), words
    trie: dict[str, Any] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})

    def alt(node: dict[str, Any]) -> str:
        # Capturing groups: `(` where `(?:` would do, as the API server estimates a
        # regex's cost by its length.
        parts = [ch + (f"({alt(sub)})?" if sub else "") for ch, sub in node.items()]
        return parts[0] if len(parts) == 1 else "(" + "|".join(parts) + ")"

    return alt(trie)


# SGLang's argparse accepts any unambiguous abbreviation (`--api-ke=x` sets --api-key), so a
# flag is refused when its name is a prefix of a managed or forbidden one, not only equal.
MANAGED_RE = "^--" + _prefixes_regex(MANAGED_FLAGS + FORBIDDEN_FLAGS) + "(=.*)?$"
