"""A prompt's token ids, exactly as the engine will see them, from the model's own tokenizer.

KV events name pages by their token ids, so the gateway must tokenize as the engine does:
the model's `tokenizer.json` (Hugging Face `tokenizers`) and, for chat, the `chat_template`
of its `tokenizer_config.json`, rendered as `transformers`' `apply_chat_template` renders it
(a sandboxed Jinja environment with `trim_blocks` and `lstrip_blocks`, the generation prompt
added, the special tokens' text given as `bos_token` / `eos_token`, and the result encoded
without adding special tokens again). A completion's prompt text is encoded with them, as
the engine's `tokenizer.encode` does.

Requests this cannot reproduce exactly (tools, multimodal parts, a template that fails)
get None, and route on the approximate index.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvfleet_gateway.inbound import EnginePrompt

log = logging.getLogger("kvfleet.gateway.prompts")

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
"""Newer checkpoints keep the chat template here; transformers prefers it to the config's."""


def _token_text(value: Any) -> str:
    """`bos_token` is a string, or an AddedToken-like object with `content`."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class PromptTokenizer:
    def __init__(self, directory: Path) -> None:
        # Read in Python, parsed from text: the file may sit on any mounted volume.
        self.tokenizer = Tokenizer.from_str((directory / TOKENIZER_FILE).read_text())
        config_path = directory / CONFIG_FILE
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        if (directory / TEMPLATE_FILE).exists():
            config["chat_template"] = (directory / TEMPLATE_FILE).read_text()
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one is used for chat
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda v, indent=None: json.dumps(
            v, ensure_ascii=False, indent=indent
        )
        self.chat_template = env.from_string(template) if isinstance(template, str) else None

    @classmethod
    def load(cls, directory: str) -> PromptTokenizer:
        """The tokenizer in `directory`, or a ValueError that says what is wrong with it."""
        path = Path(directory)
        if not (path / TOKENIZER_FILE).is_file():
            raise ValueError(f"no {TOKENIZER_FILE} in {directory}")
        try:
            return cls(path)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the tokenizer in {directory}: {e}") from None
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template in {directory} does not parse: {e}") from None
        except Exception as e:  # tokenizers raises its own (untyped) errors on a bad file
            raise ValueError(f"{directory}/{TOKENIZER_FILE} is not a tokenizer: {e}") from None

    def chat_ids(self, messages: Sequence[tuple[str, str]]) -> list[int] | None:
        if self.chat_template is None:
            return None
        try:
            text = self.chat_template.render(
                messages=[{"role": role, "content": content} for role, content in messages],
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            log.debug("chat template failed (%s): routing approximately", e)
            return None
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def text_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def ids_of(self, prompt: EnginePrompt) -> list[int] | None:
        """The token ids the engine will see for `prompt` (None: cannot be reproduced)."""
        if prompt.ids is not None:
            return list(prompt.ids)
        if prompt.text is not None:
            return self.text_ids(prompt.text)
        return self.chat_ids(prompt.messages)
