"""Shell completion: `kvfleet completion bash|zsh|fish` prints the script to source, and
`kubectl_complete-kvfleet` answers kubectl's plugin completion (kubectl 1.26+ runs it with the
words after `kubectl kvfleet`; it prints one candidate a line, then cobra's `:4` directive —
no file names). Subcommands complete from the command table without importing a command;
InferenceService names complete from the cluster the command line names, when it answers
within two seconds (otherwise nothing is offered and nothing is printed)."""

from __future__ import annotations

import sys
import threading
from typing import Any

import click
from click.shell_completion import CompletionItem, ShellComplete, get_completion_class

SHELLS = ("bash", "zsh", "fish")
ANSWER_WITHIN_S = 2.0
NO_FILE_COMPLETION = 4
"""cobra's ShellCompDirectiveNoFileComp."""


def isvc_names(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[Any]:
    """InferenceService names in the namespace of `--kubeconfig/--context/-n`, if any."""
    # Imported before the clock starts: the limit bounds the cluster's answer, and loading
    # the Kubernetes client alone can take a second on a busy machine.
    from kvfleet_cli.admin import Cluster
    from kvfleet_operator.kube import ISVC

    names: list[str] = []

    def read() -> None:
        params = ctx.params
        try:
            cluster = Cluster.connect(
                params.get("kubeconfig"), params.get("context"), params.get("namespace")
            )
            names.extend(i["metadata"]["name"] for i in cluster.items(ISVC, cluster.namespace))
        except Exception:  # completion offers nothing rather than an error
            return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(ANSWER_WITHIN_S)
    return [CompletionItem(n) for n in sorted(names) if n.startswith(incomplete)]


@click.command("completion")
@click.argument("shell", type=click.Choice(SHELLS))
def completion(shell: str) -> None:
    """Print the completion script for SHELL.

    \b
    bash:  eval "$(kvfleet completion bash)"   (in ~/.bashrc)
    zsh:   eval "$(kvfleet completion zsh)"    (in ~/.zshrc)
    fish:  kvfleet completion fish > ~/.config/fish/completions/kvfleet.fish
    The kubectl plugin completes through `kubectl_complete-kvfleet`, installed beside it."""
    root = click.get_current_context().find_root().command
    script = get_completion_class(shell)
    assert script is not None  # every choice has a class
    click.echo(script(root, {}, "kvfleet", "_KVFLEET_COMPLETE").source())


def kubectl_complete() -> None:
    """Entry point of `kubectl_complete-kvfleet`: kubectl's plugin-completion protocol."""
    from kvfleet_cli.main import plugin

    words = sys.argv[1:]
    args, incomplete = words[:-1], (words[-1] if words else "")
    found = ShellComplete(plugin, {}, "kubectl kvfleet", "").get_completions(args, incomplete)
    for item in found:
        print(item.value)
    print(f":{NO_FILE_COMPLETION}")
