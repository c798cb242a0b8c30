"""docs/install.md against the code it describes: its troubleshooting table lists exactly the
reasons the operator writes into conditions and Events, and the Dockerfile it tells users to
build builds the product packages alone (its build stage run here, without Docker)."""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import tomllib
from pathlib import Path

import setuptools

from tests.support.objects import ROOT

INSTALL = ROOT / "docs" / "install.md"
REASON_POSITION = {"condition": 3, "post_event": 3, "ScalingReport": 1}
"""Calls whose positional argument at this index is a condition's or an Event's reason."""
CAMEL = re.compile(r"^[A-Z][A-Za-z]+$")
PRODUCT_PACKAGES = {"kvfleet_kernel", "kvfleet_operator", "kvfleet_gateway", "kvfleet_cli"}


def _strings(node: ast.AST) -> set[str]:
    return {
        n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and CAMEL.match(n.value)
    }


def _target_name(t: ast.AST) -> str:
    return t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else ""


def _assigned(target: ast.AST, value: ast.AST, wanted: set[str]) -> set[str]:
    """Reason-like strings `value` gives to the names in `wanted` (tuples element-wise, both
    branches of a conditional)."""
    if isinstance(value, ast.IfExp):
        return _assigned(target, value.body, wanted) | _assigned(target, value.orelse, wanted)
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
        pairs = zip(target.elts, value.elts, strict=False)
        return set().union(*(_assigned(t, v, wanted) for t, v in pairs))
    name = _target_name(target)
    return _strings(value) if name in wanted or "reason" in name.lower() else set()


def _called(call: ast.Call) -> str:
    return _target_name(call.func)


def _at_reason_position(scope: ast.AST) -> tuple[set[str], set[str]]:
    """In `scope`: the reason strings passed literally, and the names passed instead."""
    literal: set[str] = set()
    names: set[str] = set()
    for call in ast.walk(scope):
        if not isinstance(call, ast.Call):
            continue
        i = REASON_POSITION.get(_called(call))
        if i is None or len(call.args) <= i:
            continue
        arg = call.args[i]
        if isinstance(arg, ast.Name):
            names.add(arg.id)
        elif not isinstance(arg, ast.Subscript):  # cond["reason"]: a condition re-posted
            literal |= _strings(arg)
    return literal, names


def _defaults(args: ast.arguments, names: set[str]) -> set[str]:
    positional = [*args.posonlyargs, *args.args]
    with_default = positional[len(positional) - len(args.defaults) :]
    pairs = [
        *zip(with_default, args.defaults, strict=True),
        *zip(args.kwonlyargs, args.kw_defaults, strict=True),
    ]
    return {
        s
        for a, d in pairs
        if d is not None and (a.arg in names or "reason" in a.arg.lower())
        for s in _strings(d)
    }


def reasons_in_code() -> set[str]:
    """Every reason string the operator passes to a condition or an Event: literally, through
    a variable or attribute named so (`reason`, `error_reason`, ...), or a parameter default."""
    found: set[str] = set()
    for path in (ROOT / "operator" / "kvfleet_operator").rglob("*.py"):
        for scope in ast.walk(ast.parse(path.read_text())):
            if not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            literal, names = _at_reason_position(scope)
            found |= literal
            for node in ast.walk(scope):
                if isinstance(node, ast.Assign):
                    for t in node.targets:
                        found |= _assigned(t, node.value, names)
                elif isinstance(node, ast.AnnAssign) and node.value is not None:
                    found |= _assigned(node.target, node.value, names)
                elif isinstance(node, ast.arguments):
                    found |= _defaults(node, names)
    return found


def reasons_in_docs() -> set[str]:
    """The back-quoted names in the first column of the troubleshooting table."""
    section = INSTALL.read_text().split("## Troubleshooting", 1)[1].split("\n## ", 1)[0]
    first = re.findall(r"^\| ([^|]*`[^|]*) \|", section, re.M)
    return {name for cell in first for name in re.findall(r"`([A-Za-z]+)`", cell)}


def test_the_troubleshooting_table_lists_every_reason_the_operator_writes() -> None:
    code, docs = reasons_in_code(), reasons_in_docs()
    # The collector itself: reasons set literally, through a variable, an attribute and a
    # parameter default, for conditions and Events alike.
    assert {"Serving", "DriftRepaired", "LeaderWorkerSetMissing", "InvalidSpec"} <= code
    assert {"MetricsUnavailable", "PrefillScaledUp", "ManualScaleReverted"} <= code
    assert not {"Normal", "Warning", "True", "False"} & code
    assert code - docs == set(), f"reasons the operator writes that {INSTALL.name} omits"
    assert docs - code == set(), f"reasons {INSTALL.name} lists that the operator never writes"


def dockerfile_build_stage() -> tuple[list[tuple[str, str]], str]:
    """The Dockerfile's first stage: its COPY (source, destination) pairs and its pip command."""
    text = (ROOT / "Dockerfile").read_text()
    stage = text.split("\nFROM ", 2)[1]
    copies = [
        (src, dest)
        for line in stage.splitlines()
        if line.startswith("COPY ") and "--from" not in line
        for *srcs, dest in [line.split()[1:]]
        for src in srcs
    ]
    runs = [line[4:] for line in stage.splitlines() if line.startswith("RUN ")]
    assert len(runs) == 1, runs
    return copies, runs[0]


def test_every_copy_source_of_the_dockerfile_exists() -> None:
    copies, _ = dockerfile_build_stage()
    assert copies
    for src, _ in copies:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"


def test_the_dockerfile_build_stage_installs_the_product_packages_alone(tmp_path: Path) -> None:
    """Its COPY lines into a scratch context; the packages `pip wheel .` finds there, by
    pyproject's own `packages.find` (setuptools' finder): the four product packages and
    none of the stand-ins (simulator, local cluster, benchmarks). (.ci/runtime_only.py
    installs the same tree and runs it.)"""
    copies, run = dockerfile_build_stage()
    assert shlex.split(run)[:2] == ["pip", "wheel"] and shlex.split(run)[-1] == ".", run
    context = tmp_path / "src"
    for src, dest in copies:
        target = context / dest / Path(src).name if dest.endswith("/") else context / dest
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / src).is_dir():
            shutil.copytree(ROOT / src, target)
        else:
            shutil.copyfile(ROOT / src, target)
    pyproject = tomllib.loads((context / "pyproject.toml").read_text())
    where = pyproject["tool"]["setuptools"]["packages"]["find"]["where"]
    found = {
        package.split(".")[0]
        for folder in where
        if (context / folder).is_dir()
        for package in setuptools.find_packages(where=str(context / folder))
    }
    assert found == PRODUCT_PACKAGES, found
    assert pyproject["project"]["scripts"]["kvfleet"].startswith("kvfleet_cli.")
