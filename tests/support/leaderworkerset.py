"""LeaderWorkerSet as its users install it: the published CRD (tests/data/leaderworkerset/),
and a check of an object against its schema as the API server applies it."""

from __future__ import annotations

import copy
import functools
import gzip
from pathlib import Path
from typing import Any

import yaml

from kvfleet_localcluster.validation import validate

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


def schema_problems(obj: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(errors, fields the API server would prune) of a LeaderWorkerSet against v1's schema."""
    crd = yaml.safe_load(crd_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    pruned: list[str] = []
    errors = validate(version["schema"]["openAPIV3Schema"], copy.deepcopy(obj), "", pruned)
    return errors, pruned
