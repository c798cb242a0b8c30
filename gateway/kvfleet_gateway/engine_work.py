"""Bounds on request fields that cost engine work beyond the tokens a tenant is billed.

A request's tokens are reserved and billed; some fields make each of those tokens (or the
request's set-up) far more expensive, and one tenant could make a replica slow for everyone:
100,000 alternatives per token, logprobs over a whole prompt, 20,000 logit biases, a thousand
stop strings, a 30 KB grammar to compile, `min_tokens` beyond `max_tokens`. Each is refused
with a 400 naming the field and the bound, and each bound is a setting
(`requests.bounds`). Non-finite numbers (`NaN`, which Python's JSON reads and writes but JSON
does not allow) are refused at decode (`inbound.decode`).
"""

from __future__ import annotations

import json
from typing import Any

from kvfleet_gateway.config import WorkBounds
from kvfleet_gateway.errors import bad_request

GRAMMARS = ("regex", "ebnf", "json_schema")
STOPS = ("stop", "stop_regex", "stop_token_ids")


def _over(field: str, what: str, n: int, bound: int, setting: str) -> Exception:
    return bad_request(
        f"'{field}' {what} {n:,}; this gateway allows at most {bound:,} "
        f"(requests.bounds.{setting})",
        field,
    )


def _utf8_len(text: str) -> int:
    """Bytes of `text` in UTF-8, counting a lone surrogate (which JSON's `\\ud800` escape can
    carry) as its 3 bytes: the bound is checked here, the body refused as invalid Unicode
    when it is encoded (`inbound`), never a 500 in between."""
    return len(text.encode("utf-8", "surrogatepass"))


def _count(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return 0


def check(kind: str, body: dict[str, Any], max_tokens: int, bounds: WorkBounds) -> None:
    """Refuse what `bounds` does not allow in a request body (for /generate, its top level
    and its `sampling_params`)."""
    sampling = body.get("sampling_params") if kind == "generate" else body
    where = "sampling_params." if kind == "generate" else ""
    if isinstance(sampling, dict):
        _sampling(sampling, where, max_tokens, bounds)
    if kind == "chat" and body.get("top_logprobs") is not None:
        _at_most("top_logprobs", _count(body["top_logprobs"]), bounds.top_logprobs, "topLogprobs")
    if kind == "completion":
        _at_most("logprobs", _count(body.get("logprobs")), bounds.top_logprobs, "topLogprobs")
        if body.get("echo") and body.get("logprobs") and not bounds.prompt_logprobs:
            raise bad_request(
                "'echo' with 'logprobs' asks for logprobs over the whole prompt, which this "
                "gateway does not allow (requests.bounds.promptLogprobs)",
                "echo",
            )
    if kind == "generate":
        _generate_logprobs(body, bounds)
    if isinstance(body.get("response_format"), dict):
        _response_format(body["response_format"], bounds)
    if kind == "chat" and isinstance(body.get("tools"), list):
        _tool_schemas(body["tools"], bounds)


def _at_most(field: str, n: int, bound: int, setting: str) -> None:
    if n > bound:
        raise _over(field, "asks for", n, bound, setting)


def _sampling(body: dict[str, Any], where: str, max_tokens: int, bounds: WorkBounds) -> None:
    for name in STOPS:
        value = body.get(name)
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        if len(values) > bounds.stop:
            raise _over(where + name, "has", len(values), bounds.stop, "stop")
        for v in values:
            if isinstance(v, str) and _utf8_len(v) > bounds.stop_bytes:
                raise _over(where + name, "has a string of bytes", _utf8_len(v),
                            bounds.stop_bytes, "stopBytes")  # fmt: skip
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > bounds.logit_bias:
        raise _over(where + "logit_bias", "has entries", len(bias), bounds.logit_bias, "logitBias")
    for name in GRAMMARS:
        if body.get(name) is not None:
            _grammar(where + name, body[name], bounds)
    minimum = body.get("min_new_tokens" if where else "min_tokens")
    if _count(minimum) > max_tokens:
        raise bad_request(
            f"'{where}{'min_new_tokens' if where else 'min_tokens'}' ({_count(minimum):,}) is "
            f"more than max_tokens ({max_tokens:,})",
            where + ("min_new_tokens" if where else "min_tokens"),
        )


def _grammar(field: str, value: Any, bounds: WorkBounds) -> None:
    size = _utf8_len(value) if isinstance(value, str) else len(json.dumps(value).encode())
    if size > bounds.grammar_bytes:
        raise _over(field, "is bytes long:", size, bounds.grammar_bytes, "grammarBytes")


RESPONSE_FORMATS: dict[str, frozenset[str]] = {
    "text": frozenset({"type"}),
    "json_object": frozenset({"type"}),
    "json_schema": frozenset({"type", "json_schema"}),
    "structural_tag": frozenset({"type", "structures", "triggers", "at_least_one", "format"}),
}
"""`response_format` types and their keys (SGLang 0.5's ResponseFormat, its legacy and new
structural tags); any other key is refused, not forwarded for the engine to ignore or use."""
JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})


def _response_format(fmt: dict[str, Any], bounds: WorkBounds) -> None:
    """Every grammar `response_format` can carry — a json_schema's schema, a structural tag's
    structures — is inside it: the whole object is bounded as one grammar."""
    kind = fmt.get("type")
    keys = RESPONSE_FORMATS.get(kind) if isinstance(kind, str) else None
    if keys is None:
        raise bad_request(
            f"'response_format.type' must be one of {', '.join(RESPONSE_FORMATS)}",
            "response_format.type",
        )
    for key in fmt.keys() - keys:
        raise bad_request(
            f"'response_format.{key}' is not accepted with type {kind}", f"response_format.{key}"
        )
    schema = fmt.get("json_schema")
    if kind == "json_schema" and not isinstance(schema, dict):
        raise bad_request(
            "'response_format.json_schema' must be an object", "response_format.json_schema"
        )
    for key in (schema.keys() - JSON_SCHEMA_KEYS) if isinstance(schema, dict) else ():
        raise bad_request(
            f"'response_format.json_schema.{key}' is not accepted",
            f"response_format.json_schema.{key}",
        )
    where = "response_format.json_schema" if kind == "json_schema" else "response_format"
    _grammar(where, fmt, bounds)


def _tool_schemas(tools: list[Any], bounds: WorkBounds) -> None:
    """The tools' parameter schemas become a grammar when a tool call is forced or strict:
    together they are bounded like any grammar."""
    schemas = [
        t["function"].get("parameters")
        for t in tools
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    ]
    _grammar("tools", [s for s in schemas if s is not None], bounds)


def check_token_ids(kind: str, body: dict[str, Any], vocab_size: int | None) -> None:
    """Every token id a body carries (a prompt given as ids, stop ids, logprob ids,
    logit_bias keys) is in the model's vocabulary: an id past it indexes past the engine's
    embedding and logits. Where the vocabulary is not known, ids are not forwarded."""
    where = "sampling_params." if kind == "generate" else ""
    sampling = body.get("sampling_params") if kind == "generate" else body
    found: list[tuple[str, list[int]]] = []
    ids_field = "prompt" if kind == "completion" else "input_ids"
    prompt = body.get(ids_field)
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
        found.append((ids_field, prompt))
    if isinstance(body.get("token_ids_logprob"), list):
        found.append(("token_ids_logprob", body["token_ids_logprob"]))
    if isinstance(sampling, dict):
        if isinstance(sampling.get("stop_token_ids"), list):
            found.append((where + "stop_token_ids", sampling["stop_token_ids"]))
        if isinstance(sampling.get("logit_bias"), dict):
            found.append((where + "logit_bias", [int(k) for k in sampling["logit_bias"]]))
    for field, ids in found:
        if vocab_size is None:
            raise bad_request(
                f"'{field}' names token ids, which this gateway does not forward: it does not "
                "know the model's vocabulary (routing.tuning.modelConfig)",
                field,
            )
        bad = next((i for i in ids if not 0 <= i < vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"'{field}' has the token id {bad}, outside the model's vocabulary "
                f"[0, {vocab_size})",
                field,
            )


def _generate_logprobs(body: dict[str, Any], bounds: WorkBounds) -> None:
    _at_most("top_logprobs_num", _count(body.get("top_logprobs_num")), bounds.top_logprobs,
             "topLogprobs")  # fmt: skip
    ids = body.get("token_ids_logprob")
    if isinstance(ids, list) and len(ids) > bounds.token_ids_logprob:
        raise _over("token_ids_logprob", "has ids", len(ids), bounds.token_ids_logprob,
                    "tokenIdsLogprob")  # fmt: skip
    start = body.get("logprob_start_len")
    prompt_logprobs = body.get("return_logprob") and start is not None and _count(start) >= 0
    if prompt_logprobs and not bounds.prompt_logprobs:
        raise bad_request(
            "'logprob_start_len' >= 0 asks for logprobs over the prompt, which this "
            "gateway does not allow (requests.bounds.promptLogprobs); leave it out",
            "logprob_start_len",
        )
