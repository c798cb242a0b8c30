"""The CRDs' CEL rules, as a real API server's cost estimator sees them: every list a rule
walks has `maxItems`, every string it reads has `maxLength` (or an enum), no uniqueness by
`exists_one` inside `all` (list-type map/set instead), and the costliest rule — the regex
over each extra argument — fits the per-expression and per-CRD budgets."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

from kvfleet_kernel.schema import Json
from kvfleet_operator.crd import crd, gateway_crd
from kvfleet_operator.spec_argv import MANAGED_RE

STATIC_PER_EXPRESSION = 10_000_000
"""apiextensions' StaticEstimatedCostLimit: a rule estimated above it fails CRD creation."""
STATIC_PER_CRD = 100_000_000
"""StaticEstimatedCRDCostLimit: the sum over rules, each times the cardinality of its node."""
REGEX_FACTOR = 0.25
"""cel-go's RegexStringLengthCostFactor: `matches` costs len(string) x len(regex) x 0.25."""


def _rules(schema: Json, path: str = "") -> Iterator[tuple[str, Json, str]]:
    for r in schema.get("x-kubernetes-validations") or []:
        yield path, schema, r["rule"]
        if r.get("messageExpression"):
            yield path, schema, r["messageExpression"]
    for name, sub in (schema.get("properties") or {}).items():
        yield from _rules(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _rules(schema["items"], f"{path}[]")


def _schemas() -> list[tuple[str, Json]]:
    return [
        (d["spec"]["names"]["kind"], d["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
        for d in (crd(), gateway_crd())
    ]


def _bounded(node: Json, words: set[str]) -> list[str]:
    """What a rule reading `node` would find unbounded (the item strings it names, too)."""
    if node.get("type") == "string":
        return [] if "maxLength" in node or "enum" in node else ["string without maxLength"]
    if node.get("type") != "array":
        return []
    out = [] if "maxItems" in node else ["list without maxItems"]
    items = node["items"]
    if items.get("type") == "string" and "maxLength" not in items:
        out.append("items without maxLength")
    for name, sub in (items.get("properties") or {}).items():
        if name in words and sub.get("type") == "string" and "maxLength" not in sub:
            out.append(f"item field {name} without maxLength")
    return out


def test_every_list_and_string_a_rule_walks_is_bounded() -> None:
    problems = []
    for kind, root in _schemas():
        for path, node, rule in _rules(root):
            assert not re.search(r"\.all\([^)]*exists_one", rule), (kind, path, rule)
            words = set(re.findall(r"\.(\w+)", rule))
            read = re.sub(r"has\([^)]*\)", "", rule)  # has() reads no value
            for ref in re.findall(r"self((?:\.\w+)+)", read):
                target: Any = node
                for part in ref.strip(".").split("."):
                    target = (target.get("properties") or {}).get(part)
                    if target is None:
                        break
                if target is not None:
                    problems += [f"{kind}{path}: {ref}: {p}" for p in _bounded(target, words)]
    assert problems == []


def test_the_extra_args_regex_fits_the_api_servers_budgets() -> None:
    root = dict(_schemas())["InferenceService"]
    spec = root["properties"]["spec"]["properties"]
    lists = [spec["engine"]["properties"]["extraArgs"]]
    lists.append(spec["disaggregation"]["properties"]["prefill"]["properties"]["extraArgs"])
    total = 0.0
    for lst in lists:
        item = lst["items"]
        (rule,) = item["x-kubernetes-validations"]
        assert MANAGED_RE in rule["rule"]
        per_call = item["maxLength"] * math.ceil(len(MANAGED_RE) * REGEX_FACTOR)
        assert per_call < STATIC_PER_EXPRESSION / 10, per_call
        total += per_call * lst["maxItems"]
    assert total < STATIC_PER_CRD / 2, total
