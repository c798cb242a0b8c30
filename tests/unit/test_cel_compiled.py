"""The compiled CEL rules (`kvfleet_kernel.cel`) agree with cel-python, the reference
interpreter, on every rule of every spec model, for documents drawn from each model's own
schema (fields present or absent, enum values, boundary numbers, hostile strings)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet_gateway.config import GatewayConfig
from kvfleet_kernel import cel
from kvfleet_kernel.schema import ConfigError, Json, Rule, _unwrap_optional, interpret, openapi
from kvfleet_operator.gateway_spec import InferenceGatewaySpec
from kvfleet_operator.spec import EXTRA_ARG_RULE, InferenceServiceSpec

STRINGS = st.sampled_from(
    ["", "events", "memory", "kvfleet", "NGRAM", "EAGLE", "redis://u:p@h:6379", "redis://h",
     "--port=1", "--api-ke=x", "--max-prefill-tokens=9", "a", "q_proj"]
)  # fmt: skip


def _value(schema: Json, depth: int) -> st.SearchStrategy[Any]:
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        return st.integers(-2, 9)
    if kind == "number":
        return st.sampled_from([-1.0, 0.0, 0.5, 2.0, 3])
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return STRINGS
    if kind == "array":
        return st.lists(_value(schema["items"], depth + 1), max_size=3 if depth < 2 else 1)
    if kind == "object" and schema.get("properties") and depth < 3:
        return _document(schema, depth + 1)
    return st.just({})


def _document(schema: Json, depth: int = 0) -> st.SearchStrategy[Json]:
    """An object as the parser hands it to the rules: required and defaulted fields always
    there (the parser fills defaults), optional ones present or not."""
    props = schema.get("properties") or {}
    always = set(schema.get("required") or ()) | {k for k, v in props.items() if "default" in v}
    fields = {
        k: _value(v, depth) if k in always else st.one_of(st.none(), _value(v, depth))
        for k, v in props.items()
    }
    return st.fixed_dictionaries(fields).map(
        lambda d: {k: v for k, v in d.items() if v is not None}
    )


def _rule_classes() -> list[type]:
    seen: list[type] = []

    def walk(cls: type) -> None:
        if cls in seen:
            return
        seen.append(cls)
        for tp in typing.get_type_hints(cls).values():
            tp, _ = _unwrap_optional(tp)
            for t in (tp, *typing.get_args(tp)):
                if dataclasses.is_dataclass(t) and isinstance(t, type):
                    walk(t)

    for root in (InferenceServiceSpec, InferenceGatewaySpec, GatewayConfig):
        walk(root)
    return [c for c in seen if getattr(c, "RULES", ())]


def _outcome(run: typing.Callable[[], bool]) -> bool | str:
    try:
        return bool(run())
    except (cel.CelError, ConfigError):
        return "error"


@pytest.mark.parametrize("cls", _rule_classes(), ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_compiled_rules_agree_with_cel_python(cls: type, data: st.DataObject) -> None:
    document = data.draw(_document(openapi(cls)))
    rules: tuple[Rule, ...] = cls.RULES  # type: ignore[attr-defined]
    for r in rules:
        compiled = _outcome(lambda rule=r.rule: cel.evaluate(rule, document))
        reference = _outcome(lambda rule=r.rule: interpret(rule, document))
        assert compiled == reference, (r.rule, document)


def test_every_rule_compiles() -> None:
    """No rule falls back to the interpreter (whose cost grows with the document)."""
    for cls in _rule_classes():
        for r in cls.RULES:  # type: ignore[attr-defined]
            cel.compile_rule(r.rule)


ARGS = ["--port=1", "--por", "--api-ke=x", "--enable-torch-compile", "--log-level=debug",
        "--lora-paths", "x=y", "", "--", "--tp", "--tp-size=2", "--tpx", "-p"]  # fmt: skip


@pytest.mark.parametrize("arg", ARGS)
def test_the_extra_args_rule_agrees_with_cel_python(arg: str) -> None:
    rule = EXTRA_ARG_RULE.rule
    assert _outcome(lambda: cel.evaluate(rule, arg)) == _outcome(lambda: interpret(rule, arg))


@pytest.mark.parametrize(
    ("rule", "document", "expected"),
    [
        ("self.a.all(x, x > 0) && size(self.a) == 2", {"a": [1, 2]}, True),
        ("self.a.exists_one(x, x == 1)", {"a": [1, 1]}, False),
        ("self.a.filter(x, x > 1).map(x, x * 2) == [4, 6]", {"a": [1, 2, 3]}, True),
        ("self.missing > 0 || true", {}, True),  # CEL's logic absorbs the error
        ("self.n % 3 == -1", {"n": -7}, True),  # truncated, as Go
        ("'b' in self.l && !('c' in self.l)", {"l": ["a", "b"]}, True),
        ("self.s.matches('^x+$') ? 1 : 2", {"s": "xx"}, 1),
    ],
)
def test_constructs(rule: str, document: Json, expected: Any) -> None:
    assert cel.evaluate(rule, document) == expected
    assert _outcome(lambda: interpret(rule, document)) == bool(expected)
