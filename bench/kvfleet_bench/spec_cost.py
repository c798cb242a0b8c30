"""`kvfleet bench spec`: what one InferenceService at the CRD's largest allowed sizes costs
the operator to parse (schema checks and every CEL rule, as on each reconcile).

The operator has one reconcile worker and parses a spec on every resync and child event, so
the parse of the largest spec the API server admits bounds how long one author can hold it.
Every list is filled to its `maxItems` and every string to its `maxLength` (read from the
CRD, so the bench follows the schema); the tenants' model allow-lists, which nest inside the
1,000 tenants, get `TENANT_MODELS` entries each, keeping the object under etcd's 1.5 MiB.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from kvfleet_kernel.schema import Json, openapi
from kvfleet_operator.spec import InferenceServiceSpec, parse_spec

TENANT_MODELS = 8
"""Entries in each tenant's `models`: 1,000 tenants × 1,000 models would be 1M strings, far
past what an API server stores in one object (etcd's default request limit, 1.5 MiB)."""
ETCD_LIMIT = int(1.5 * 1024 * 1024)


def _schema_at(path: str) -> Json:
    node = openapi(InferenceServiceSpec)
    for key in path.split("."):
        node = node["items"] if key == "[]" else node["properties"][key]
    return node


def max_items(path: str) -> int:
    return int(_schema_at(path)["maxItems"])


def max_length(path: str) -> int:
    node = _schema_at(path)
    return int((node.get("items") or node)["maxLength"])


def _word(prefix: str, i: int, length: int) -> str:
    """A name of exactly `length` characters (letters, digits, '-'), distinct per `i`."""
    head = f"{prefix}{i}-"
    return head + "x" * (length - len(head))


def _common() -> Json:
    aliases, alias_len = max_items("model.aliases"), max_length("model.aliases")
    env = max_items("engine.env")
    env_value = max_length("engine.env.[].value")
    args = max_items("engine.extraArgs")
    arg_len = max_length("engine.extraArgs")
    return {
        "model": {
            "name": _word("m", 0, max_length("model.name")),
            "source": {"huggingFace": "org/" + "m" * (max_length("model.source.huggingFace") - 4)},
            "revision": "r" * max_length("model.revision"),
            "aliases": [_word("alias", i, alias_len) for i in range(aliases)],
            "price": {"prompt": 1.0, "cached": 0.5, "output": 2.0},
        },
        "engine": {
            "env": [{"name": f"VAR_{i}", "value": "v" * env_value} for i in range(env)],
            # Values of a flag the operator does not manage, each as long as allowed.
            "extraArgs": [f"--max-prefill-tokens={'9' * (arg_len - 21)}"] * args,
        },
        "gateway": {
            "insecureNoAuth": True,
            "tenants": [
                {
                    "name": f"tenant-{i}",
                    "limits": {"models": [f"m{j}" for j in range(TENANT_MODELS)]},
                }
                for i in range(max_items("gateway.tenants"))
            ],
        },
        "scheduling": {
            "tolerations": [
                {"key": f"k{i}", "operator": "Exists"}
                for i in range(max_items("scheduling.tolerations"))
            ]
        },
    }


def largest_lora_spec() -> Json:
    """Every adapter the CRD allows, with the longest names, beside the longest lists."""
    spec = _common()
    name_len = max_length("lora.adapters.[].name")
    spec["lora"] = {
        "adapters": [
            {"name": _word("a", i, name_len), "source": {"huggingFace": f"org/adapter-{i}"}}
            for i in range(max_items("lora.adapters"))
        ],
        "maxLoraRank": 64,
        "targetModules": [
            _word("mod_", i, max_length("lora.targetModules")).replace("-", "_")
            for i in range(max_items("lora.targetModules"))
        ],
    }
    return spec


def largest_pd_spec() -> Json:
    """Disaggregated (it excludes LoRA): the prefill pool's extraArgs at their bound too."""
    spec = _common()
    spec["disaggregation"] = {"prefill": {"extraArgs": spec["engine"]["extraArgs"]}}
    return spec


CASES: dict[str, Callable[[], Json]] = {"lora": largest_lora_spec, "disaggregated": largest_pd_spec}


def time_parse(spec: Json, runs: int = 5) -> float:
    """The median CPU seconds of one parse of `spec`, after one parse that compiles the
    rules and patterns (once per operator process). Each parse is of a distinct document:
    the parser's memo of equal documents would hide the cost a changed spec pays. CPU time,
    not wall time: other processes on the machine do not count."""
    parse_spec({**spec, "replicas": 1000})
    times = []
    for i in range(runs):
        document = {**spec, "replicas": i + 1}
        start = time.process_time()
        parse_spec(document)
        times.append(time.process_time() - start)
    return statistics.median(times)


def run_spec_bench(echo: Callable[[str], None], runs: int = 5) -> dict[str, Any]:
    """Parse time of each largest spec; the figures `kvfleet bench spec` prints."""
    out: dict[str, Any] = {}
    for name, build in CASES.items():
        spec = build()
        size = len(json.dumps(spec))
        seconds = time_parse(spec, runs)
        out[name] = {"seconds": seconds, "bytes": size}
        echo(f"{name}: parse {seconds * 1000:.1f} ms (median of {runs}); {size:,} bytes of JSON")
    return out
