"""Generate `data/omitempty-<version>.json` from the Go types of kubernetes/api and
kubernetes/apimachinery at one release tag: which JSON fields of which built-in types a real
API server leaves out when their value is the zero value.

Go's encoding/json (which kube-apiserver's serializer follows) omits a field tagged
`omitempty` when its value is false, 0, "" (basic kinds, named ones included), an empty slice
or map, or a nil pointer; a struct value is never omitted. The output maps each type's OpenAPI
definition name (`io.k8s.api.core.v1.Container`) to its omitempty fields and which of those
rules applies: `zero`, `empty` or `nil`.

    python -m kvfleet_localcluster.omitempty_gen API_CHECKOUT APIMACHINERY_CHECKOUT TAG OUT

The checkouts are git directories holding the tag (`git show TAG:path` is read; nothing is
built or run). Maintainers regenerate the file when the local cluster's version changes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

BASIC = {
    "string",
    "bool",
    "int",
    "int32",
    "int64",
    "uint32",
    "uint64",
    "float32",
    "float64",
    "byte",
}
STRUCT_RE = re.compile(r"^type (\w+) struct \{\n(.*?)^\}", re.M | re.S)
NAMED_RE = re.compile(r"^type (\w+) (\S.*)$", re.M)
FIELD_RE = re.compile(r'^\s+(?:\w+\s+)?(\S+)\s+`json:"([^",]*)((?:,[a-z]+)*)"', re.M)


def _files(repo: Path, tag: str, prefix: str) -> list[str]:
    paths = [prefix] if prefix else []
    out = subprocess.run(
        ["git", "-C", str(repo), "ls-tree", "-r", "--name-only", tag, *paths],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return [f for f in out.split() if f.endswith("types.go") or f.endswith("/time.go")]


def _show(repo: Path, tag: str, path: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "show", f"{tag}:{path}"], check=True, capture_output=True,
        text=True,
    ).stdout  # fmt: skip


def _rule(go_type: str, named: dict[str, str]) -> str | None:
    """How encoding/json's omitempty treats a field of this Go type (None: never omitted)."""
    seen = 0
    while go_type in named and seen < 5:  # a named type: its underlying type decides
        go_type, seen = named[go_type], seen + 1
    if go_type.startswith("*"):
        return "nil"
    if go_type.startswith("[]") or go_type.startswith("map["):
        return "empty"
    return "zero" if go_type in BASIC else None


def definitions(repo: Path, tag: str, prefix: str, package_of: str) -> dict[str, dict[str, str]]:
    """{definition name: {json field: rule}} for every struct under `prefix` in `repo`."""
    out: dict[str, dict[str, str]] = {}
    for path in _files(repo, tag, prefix):
        source = re.sub(r"//[^\n]*", "", _show(repo, tag, path))
        named = {n: t.strip() for n, t in NAMED_RE.findall(source) if not t.startswith("struct")}
        package = package_of + path.rsplit("/", 1)[0].replace("/", ".")
        for struct, body in STRUCT_RE.findall(source):
            fields = {}
            for go_type, name, options in FIELD_RE.findall(body):
                rule = _rule(go_type, named)
                if name and "omitempty" in options and rule is not None:
                    fields[name] = rule
            if fields:
                out[f"{package}.{struct}"] = fields
    return out


def main(argv: list[str]) -> None:
    api, machinery, tag, target = Path(argv[0]), Path(argv[1]), argv[2], Path(argv[3])
    doc = {
        "source": f"kubernetes/api and kubernetes/apimachinery at {tag}, json omitempty tags",
        "definitions": {
            **definitions(api, tag, "", "io.k8s.api."),
            **definitions(machinery, tag, "pkg/apis/meta/v1", "io.k8s.apimachinery."),
        },
    }
    target.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
