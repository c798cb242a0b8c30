"""The engine command lines and every hand-kept table of SGLang flags, checked with SGLang's
own argument parser (the release the operator renders for, `ENGINE_IMAGE`). The parser comes
from `.ci/sglang-parser.txt`, which `.ci/run` installs: skipped where it is not installed,
a failure under CI."""

from __future__ import annotations

import argparse
import typing
from importlib import metadata
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfleet_cli.main import cli
from kvfleet_localcluster.containers import SIM_FLAGS, SIM_LISTS, SIM_VALUES
from kvfleet_operator.spec import (
    ENGINE_IMAGE,
    Disaggregation,
    EngineSpec,
    Quantization,
    SchedulePolicy,
)
from kvfleet_operator.spec_argv import FORBIDDEN_FLAGS, MANAGED_FLAGS
from kvfleet_sim.config import KV_CACHE_DTYPES, QUANTIZATIONS, SCHEDULE_POLICIES
from kvfleet_sim.disaggregation import TRANSFER_BACKENDS
from tests.conftest import IN_CI

# Importing SGLang imports torch and its CUDA libraries: over a minute on a busy machine.
pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError as exc:
        if IN_CI:
            pytest.fail(f"SGLang's parser is required in CI (.ci/run installs it): {exc}")
        pytest.skip(
            f"SGLang's parser is not installed (pip install -r .ci/sglang-parser.txt): {exc}"
        )
    p = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(p)
    return p


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


def test_the_parser_is_the_release_the_operator_renders_for(
    parser: argparse.ArgumentParser,
) -> None:
    assert ENGINE_IMAGE.endswith(":v" + metadata.version("sglang"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_render_check_with_sglangs_own_parser(path: Path, parser: argparse.ArgumentParser) -> None:
    result = CliRunner().invoke(cli, ["render", "--check", "-f", str(path)])
    assert result.exit_code == 0, result.stderr


def test_managed_and_forbidden_flags_are_sglangs(parser: argparse.ArgumentParser) -> None:
    options = _options(parser)
    unknown = [f for f in (*MANAGED_FLAGS, *FORBIDDEN_FLAGS) if f"--{f}" not in options]
    assert unknown == []


def test_the_kubelets_flag_table_agrees_with_the_parser(parser: argparse.ArgumentParser) -> None:
    """SIM_FLAGS says which SGLang flags take a value; the kubelet reads a command line by it
    (a wrong entry would swallow the next flag as a value, or a value as a flag). Each is
    read as SGLang reads it: the flag, or the one flag it abbreviates (`--tp`)."""
    disagree = {}
    for flag, takes in SIM_FLAGS.items():
        found = parser._parse_optional(flag)
        action = found[0] if found else None
        if action is None or (action.nargs != 0) != takes:
            disagree[flag] = (takes, action.nargs if action else "no such flag")
    assert disagree == {}
    lists = {flag: _options(parser)[flag].nargs for flag in SIM_LISTS}
    assert all(n in ("*", "+") for n in lists.values()), lists


def _choices(parser: argparse.ArgumentParser, flag: str) -> set[str]:
    choices = _options(parser)[flag].choices
    assert choices is not None, f"{flag} takes any value"
    return {str(c) for c in choices}


def _literal(owner: type, field: str) -> set[str]:
    return {str(v) for v in typing.get_args(typing.get_type_hints(owner)[field])}


def test_every_value_table_is_a_subset_of_sglangs_choices(
    parser: argparse.ArgumentParser,
) -> None:
    """The spec's and the simulator's values of flags SGLang restricts (its
    --speculative-algorithm takes any string: no table to check). The simulator's
    `--quantization none` means the flag absent."""
    tables = {
        "--quantization": [set(typing.get_args(Quantization)), set(QUANTIZATIONS) - {"none"},
                           SIM_VALUES["--quantization"] - {"none"}],
        "--schedule-policy": [set(typing.get_args(SchedulePolicy)), set(SCHEDULE_POLICIES),
                              SIM_VALUES["--schedule-policy"]],
        "--kv-cache-dtype": [_literal(EngineSpec, "kv_cache_dtype"), set(KV_CACHE_DTYPES)],
        "--disaggregation-transfer-backend": [_literal(Disaggregation, "transfer_backend"),
                                              set(TRANSFER_BACKENDS)],
    }  # fmt: skip
    outside = {
        flag: sorted(set().union(*(t - _choices(parser, flag) for t in ts)))
        for flag, ts in tables.items()
    }
    assert outside == {flag: [] for flag in tables}
