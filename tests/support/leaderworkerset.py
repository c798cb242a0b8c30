"""LeaderWorkerSet as its users install it: the published CRD (tests/data/leaderworkerset/),
and a check of an object against its structural schema (JSON Schema, as the API server
validates it; a field the schema does not declare is one the API server would prune)."""

from __future__ import annotations

import functools
import gzip
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRD_FILE = (
    Path(__file__).resolve().parents[1]
    / "data"
    / "leaderworkerset"
    / "leaderworkerset.x-k8s.io_leaderworkersets-v0.9.0.yaml.gz"
)


@functools.cache
def crd_text() -> str:
    return gzip.decompress(CRD_FILE.read_bytes()).decode()


def write_crd(directory: Path) -> Path:
    """The CRD as a YAML file, for `kubectl apply --server-side -f`."""
    path = directory / "leaderworkersets.yaml"
    path.write_text(crd_text())
    return path


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with every object of declared properties closed to others: JSON Schema then
    reports, as `additionalProperties` errors, the fields the API server would prune."""
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {k: _closed(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = _closed(schema[key])
    return out


def schema_problems(obj: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(errors, fields the API server would prune) of a LeaderWorkerSet against v1's schema."""
    crd = yaml.safe_load(crd_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    validator = jsonschema.Draft4Validator(_closed(version["schema"]["openAPIV3Schema"]))
    errors: list[str] = []
    pruned: list[str] = []
    for error in validator.iter_errors(obj):
        where = ".".join(str(p) for p in error.absolute_path)
        unknown = error.validator == "additionalProperties" and error.validator_value is False
        (pruned if unknown else errors).append(f"{where}: {error.message}")
    return errors, pruned
