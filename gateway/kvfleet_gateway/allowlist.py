"""Which request fields the gateway forwards to an engine, per endpoint.

An engine acts on every field it understands, and SGLang understands many that a client of a
shared, metered fleet must not set: `rid` (request ids are the handle `abort_request` uses),
`bootstrap_*` and `routed_dp_rank` (disaggregation and data-parallel plumbing), `input_embeds`
and media (prompt sizes the gateway cannot bound), `custom_logit_processor` (a serialized
Python callable run inside the engine), `lora_path` (which adapter to load), `priority`
(queue jumping). So the gateway keeps three lists:

* **allowed** — OpenAI's fields and SGLang's sampling extras: forwarded as sent;
* **governed** — cost- or safety-relevant extras: refused with 400 unless the gateway config
  names them in `requests.allow`;
* everything else — refused with 400 naming the field, or dropped silently when
  `requests.unknownFields: drop`.
"""

from __future__ import annotations

from typing import Any, Literal

from kvfleet_gateway.errors import bad_request

Endpoint = Literal["chat", "completion", "generate"]

_SAMPLING = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "ignore_eos",
        "skip_special_tokens",
        "no_stop_trim",
        "regex",
        "ebnf",
        "json_schema",
        "logit_bias",
    }
)
_OPENAI_COMMON = _SAMPLING | {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "n",
    "seed",
    "user",
    "logprobs",
    "response_format",
    "min_tokens",
    "cache_salt",
    "return_token_ids",
    "return_cached_tokens_details",
}
ALLOWED: dict[Endpoint, frozenset[str]] = {
    "chat": _OPENAI_COMMON
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "reasoning_effort",
        "continue_final_message",
        "separate_reasoning",
        "stream_reasoning",
        "chat_template_kwargs",
        "return_prompt_token_ids",
        "input_ids",
    },
    "completion": _OPENAI_COMMON | {"prompt", "echo", "suffix", "best_of"},
    "generate": frozenset(
        {
            "model",
            "text",
            "input_ids",
            "sampling_params",
            "stream",
            "return_logprob",
            "logprob_start_len",
            "top_logprobs_num",
            "token_ids_logprob",
            "return_text_in_logprobs",
            "cache_salt",
        }
    ),
}
SAMPLING_PARAMS = _SAMPLING | {
    "max_new_tokens",
    "min_new_tokens",
    "n",
    "spaces_between_special_tokens",
    "sampling_seed",
}
"""Keys of /generate's `sampling_params`."""
MESSAGE_FIELDS = frozenset(
    {"role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content", "tools"}
)
TEXT_PARTS = frozenset({"text", "thinking", "reasoning"})
"""Content-part types whose text the template renders; media parts cannot be bounded."""

Governed = Literal[
    "lora_path",
    "custom_logit_processor",
    "custom_params",
    "priority",
    "return_hidden_states",
    "return_routed_experts",
]
GOVERNED: dict[str, str] = {
    "lora_path": "selects a LoRA adapter: the engine loads it (memory, latency)",
    "custom_logit_processor": "runs a serialized Python callable inside the engine",
    "custom_params": "parameters for a custom logit processor",
    "priority": "moves the request ahead of other tenants' in the engine's queue",
    "return_hidden_states": "returns hidden states: large responses, slower decoding",
    "return_routed_experts": "returns MoE routing: large responses",
}
"""Engine extras a gateway config may enable by name (`requests.allow`)."""


def check_fields(
    where: str,
    body: dict[str, Any],
    allowed: frozenset[str],
    enabled: frozenset[str],
    drop_unknown: bool,
) -> None:
    """Refuse (or drop) the keys of `body` that are not allowed; `where` names the object in
    errors (`''` for the top level, else e.g. `sampling_params.`)."""
    for key in [k for k in body if k not in allowed]:
        if key in GOVERNED:
            if key in enabled:
                continue
            raise bad_request(
                f"'{where}{key}' is not enabled on this gateway: it {GOVERNED[key]} "
                "(an administrator can allow it in the gateway config, requests.allow)",
                f"{where}{key}",
            )
        if drop_unknown:
            del body[key]
            continue
        raise bad_request(f"unrecognized request argument: '{where}{key}'", f"{where}{key}")
