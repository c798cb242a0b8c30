"""The `kvfleet` command: product commands, and stand-in commands loaded only when run.

Subcommands are imported when they are invoked, never at start: `kvfleet gateway` does not
load the operator, and no product command loads a stand-in (the simulator, the local
cluster, the benchmarks). A stand-in command run where its extra is not installed says which
extra to install instead of printing a traceback.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import click
from click.shell_completion import CompletionItem


@dataclass(frozen=True)
class Entry:
    module: str
    attr: str
    summary: str
    """Shown by `kvfleet --help` without importing the command."""
    extra: str | None = None
    """The pip extra a stand-in command needs; None: a product command."""


COMMANDS: dict[str, Entry] = {
    "operator": Entry(
        "kvfleet_cli.operator_cmds", "operator", "Run the operator (kopf) against a cluster."
    ),
    "render": Entry(
        "kvfleet_cli.operator_cmds", "render", "Print the children of InferenceServices in FILE."
    ),
    "crds": Entry("kvfleet_cli.operator_cmds", "crds", "Write the CRD generated from the spec."),
    "docs": Entry(
        "kvfleet_cli.operator_cmds", "docs", "Write the CRD and gateway-config references."
    ),
    "get": Entry("kvfleet_cli.admin", "get", "List InferenceServices with their live numbers."),
    "describe": Entry(
        "kvfleet_cli.admin", "describe_cmd", "Show an InferenceService, its children and events."
    ),
    "logs": Entry("kvfleet_cli.admin", "logs", "Print an InferenceService's pods' logs."),
    "top": Entry("kvfleet_cli.top_cmds", "top", "Live per-replica queue, KV cache, tokens/s."),
    "usage": Entry(
        "kvfleet_cli.usage_cmds", "usage", "Tokens, requests, budget and cost per tenant."
    ),
    "gateway": Entry("kvfleet_cli.gateway_cmds", "gateway", "Run the token-aware gateway."),
    "keys": Entry(
        "kvfleet_cli.keys_cmds", "keys", "API keys: create, list, revoke, rotate; new, hash."
    ),
    "budgets": Entry("kvfleet_cli.gateway_cmds", "budgets", "Accept a lost budget store (Redis)."),
    "completion": Entry(
        "kvfleet_cli.completion",
        "completion",
        "Print the shell completion script (bash, zsh, fish).",
    ),
    "fetch-tokenizer": Entry(
        "kvfleet_cli.gateway_cmds",
        "fetch_tokenizer",
        "Download a model's tokenizer from the Hugging Face Hub (gateway init container).",
    ),
    "sim": Entry(
        "kvfleet_sim.cli", "sim", "Stand-in: the SGLang-compatible engine simulator.", "sim"
    ),
    "cluster": Entry(
        "kvfleet_localcluster.cli", "cluster", "Stand-in: a local Kubernetes cluster.", "cluster"
    ),
    "bench": Entry("kvfleet_bench.cli", "bench", "Benchmarks; reports in bench/results/.", "bench"),
    "demo": Entry(
        "kvfleet_bench.demo.fleet",
        "demo",
        "The whole stack on one machine, no GPU, no cluster.",
        "bench",
    ),
}


class StandInMissing(click.ClickException):
    def __init__(self, name: str, entry: Entry, missing: str) -> None:
        super().__init__(
            f"`kvfleet {name}` is a development stand-in, not part of the product install "
            f"(module {missing!r} is missing): pip install 'kvfleet[{entry.extra}]'"
        )


def load(name: str) -> click.Command:
    entry = COMMANDS[name]
    try:
        module = importlib.import_module(entry.module)
    except ModuleNotFoundError as exc:
        if entry.extra is None:  # a product command must always import: a real bug
            raise
        raise StandInMissing(name, entry, exc.name or str(exc)) from None
    command: click.Command = getattr(module, entry.attr)
    return command


PLUGIN_COMMANDS = ("get", "describe", "logs", "top", "usage", "keys")
"""What `kubectl kvfleet` offers: the admin commands (the rest is `kvfleet ...`)."""


class LazyGroup(click.Group):
    only: tuple[str, ...] | None = None
    """The subcommands this group offers (None: all of COMMANDS)."""

    def _names(self) -> list[str]:
        return [n for n in COMMANDS if self.only is None or n in self.only]

    def list_commands(self, ctx: click.Context) -> list[str]:
        return self._names()

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self._names():
            return None
        return load(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name].summary) for name in self._names()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[CompletionItem]:
        """Subcommand names from the table, without importing any command."""
        if incomplete.startswith("-"):
            return super().shell_complete(ctx, incomplete)
        return [
            CompletionItem(n, help=COMMANDS[n].summary)
            for n in self._names()
            if n.startswith(incomplete)
        ]


class PluginGroup(LazyGroup):
    only = PLUGIN_COMMANDS


CONTEXT = {"help_option_names": ["-h", "--help"]}


@click.group(cls=LazyGroup, context_settings=CONTEXT)
@click.version_option(package_name="kvfleet")
def cli() -> None:
    """kvfleet: LLM inference on Kubernetes — operator, gateway and a GPU-free SGLang simulator."""


@click.group(cls=PluginGroup, context_settings=CONTEXT)
@click.version_option(package_name="kvfleet")
def plugin() -> None:
    """kubectl kvfleet: kvfleet's InferenceServices — their numbers, pods, logs, usage and keys."""


def kubectl_plugin() -> None:
    """Entry point of `kubectl-kvfleet`: kubectl runs it as `kubectl kvfleet ...`."""
    plugin(prog_name="kubectl kvfleet")
