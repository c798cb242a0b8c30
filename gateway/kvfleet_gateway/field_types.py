"""The JSON type of every request field the gateway forwards, checked strictly.

SGLang reads requests with pydantic in lax mode: `"100000"`, `1e5` and `100000.0` all become
the integer 100000, `"true"` becomes True. A bound the gateway checks on one type and the
engine applies to another is no bound (`top_logprobs: "100000"` once passed as 0 and was
served as 100,000). So each field has one JSON type here, checked as JSON has it: an integer
field takes only a JSON integer (no fraction, no exponent, no string, not a boolean), a
number field an integer or a float, a boolean field `true` or `false`. Anything else is a 400
naming the field and the type. `null` is accepted for every field and means "not set": the
gateway leaves the field out of what it forwards, so the engine applies its own default.

Objects whose keys an engine acts on (`stream_options`, `response_format`,
`chat_template_kwargs`, /generate's `sampling_params`) have their own typed key lists here or
in `engine_work`; `messages`, `tools` and `tool_choice` are free-form JSON whose bytes the
prompt bound counts (see `inbound`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvfleet_gateway.allowlist import SAMPLING_PARAMS, Endpoint
from kvfleet_gateway.errors import bad_request

Check = Callable[[Any], bool]


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _boolean(v: Any) -> bool:
    return isinstance(v, bool)


def _string(v: Any) -> bool:
    return isinstance(v, str)


def _strings(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


def _integers(v: Any) -> bool:
    return isinstance(v, list) and all(_integer(i) for i in v)


def _object(v: Any) -> bool:
    return isinstance(v, dict)


def _any(v: Any) -> bool:
    return True


def _bias(v: Any) -> bool:
    """logit_bias: token id (a decimal string, as JSON keys are) → a number."""
    return isinstance(v, dict) and all(k.isdecimal() and _number(b) for k, b in v.items())


def _prompt(v: Any) -> bool:
    return _strings(v) or _integers(v)


def _effort(v: Any) -> bool:
    return v in REASONING_EFFORTS


def _thinking_mode(v: Any) -> bool:
    return v in THINKING_MODES


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
"""SGLang 0.5's reasoning_effort tiers (the gateway does not forward its float form)."""
THINKING_MODES = ("enabled", "disabled", "chat", "thinking")
DESCRIBE: dict[Check, str] = {
    _integer: "an integer",
    _number: "a number",
    _boolean: "a boolean",
    _string: "a string",
    _strings: "a string or an array of strings",
    _integers: "an array of integers",
    _object: "an object",
    _bias: "an object of token ids (decimal strings) to numbers",
    _prompt: "a string, an array of strings or an array of token ids",
    _effort: "one of " + ", ".join(REASONING_EFFORTS),
    _thinking_mode: "one of " + ", ".join(THINKING_MODES),
    _any: "JSON",
}

SAMPLING: dict[str, Check] = {
    "temperature": _number,
    "top_p": _number,
    "top_k": _integer,
    "min_p": _number,
    "frequency_penalty": _number,
    "presence_penalty": _number,
    "repetition_penalty": _number,
    "stop": _strings,
    "stop_token_ids": _integers,
    "stop_regex": _strings,
    "ignore_eos": _boolean,
    "skip_special_tokens": _boolean,
    "no_stop_trim": _boolean,
    "regex": _string,
    "ebnf": _string,
    "json_schema": _string,
    "logit_bias": _bias,
}
GOVERNED_TYPES: dict[str, Check] = {
    "lora_path": _string,
    "custom_logit_processor": _string,
    "custom_params": _object,
    "priority": _integer,
    "return_hidden_states": _boolean,
    "return_routed_experts": _boolean,
}
_OPENAI: dict[str, Check] = {
    **SAMPLING,
    "model": _string,
    "stream": _boolean,
    "stream_options": _object,
    "max_tokens": _integer,
    "n": _integer,
    "seed": _integer,
    "user": _string,
    "response_format": _object,
    "min_tokens": _integer,
    "cache_salt": _string,
    "return_token_ids": _boolean,
    "return_cached_tokens_details": _boolean,
}
TYPES: dict[Endpoint, dict[str, Check]] = {
    "chat": {
        **_OPENAI,
        "messages": _any,
        "max_completion_tokens": _integer,
        "logprobs": _boolean,
        "top_logprobs": _integer,
        "tools": _any,
        "tool_choice": _any,
        "parallel_tool_calls": _boolean,
        "reasoning_effort": _effort,
        "continue_final_message": _boolean,
        "separate_reasoning": _boolean,
        "stream_reasoning": _boolean,
        "chat_template_kwargs": _object,
        "return_prompt_token_ids": _boolean,
        "input_ids": _integers,
        **GOVERNED_TYPES,
    },
    "completion": {
        **_OPENAI,
        "prompt": _prompt,
        "echo": _boolean,
        "suffix": _string,
        "best_of": _integer,
        "logprobs": _integer,
        **GOVERNED_TYPES,
    },
    "generate": {
        "model": _string,
        "text": _string,
        "input_ids": _integers,
        "sampling_params": _object,
        "stream": _boolean,
        "return_logprob": _boolean,
        "logprob_start_len": _integer,
        "top_logprobs_num": _integer,
        "token_ids_logprob": _integers,
        "return_text_in_logprobs": _boolean,
        "cache_salt": _string,
        **GOVERNED_TYPES,
    },
}
"""Each endpoint's fields (allowed and governed, `allowlist`) and their JSON types."""
SAMPLING_PARAM_TYPES: dict[str, Check] = {
    **SAMPLING,
    "max_new_tokens": _integer,
    "min_new_tokens": _integer,
    "n": _integer,
    "spaces_between_special_tokens": _boolean,
    "sampling_seed": _integer,
}
STREAM_OPTIONS: dict[str, Check] = {"include_usage": _boolean, "continuous_usage_stats": _boolean}
CHAT_TEMPLATE_KWARGS: dict[str, Check] = {
    "enable_thinking": _boolean,
    "thinking": _boolean,
    "reasoning_effort": _effort,
    "thinking_mode": _thinking_mode,
    "force_nonempty_content": _boolean,
    "spaces_between_special_tokens": _boolean,
}
"""The template switches SGLang 0.5's chat serving reads (Qwen 3, GLM: enable_thinking;
DeepSeek, Kimi: thinking; gpt-oss: reasoning_effort; MiniMax, DeepSeek 3.2: thinking_mode).
Every other key is refused: the template runner renders or executes what it is given
(`chat_template` replaces the template itself; `tools`, `documents` are rendered as prompt
text the gateway would not have bounded)."""
assert set(SAMPLING_PARAM_TYPES) == SAMPLING_PARAMS


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number with a fraction or an exponent"
    if isinstance(v, str):
        return "a string"
    return "an array" if isinstance(v, list) else "an object"


def check_types(where: str, body: dict[str, Any], types: dict[str, Check]) -> None:
    """Refuse a field of `body` whose value is not of its type; drop those set to null.
    Fields not in `types` are left to the allow-list (`allowlist.check_fields`)."""
    for key in list(body):
        value = body[key]
        if value is None:
            del body[key]
            continue
        check = types.get(key)
        if check is not None and not check(value):
            raise bad_request(
                f"'{where}{key}' must be {DESCRIBE[check]}, got {_json_type(value)}",
                f"{where}{key}",
            )


def check_object(where: str, value: dict[str, Any], types: dict[str, Check], why: str) -> None:
    """An object whose keys an engine acts on: only the keys of `types`, each of its type;
    `why` says in the refusal why others are not forwarded."""
    for key in value:
        if key not in types:
            allowed = ", ".join(types)
            raise bad_request(
                f"'{where}{key}' is not accepted: {why} (accepted: {allowed})", f"{where}{key}"
            )
    check_types(where, value, types)
