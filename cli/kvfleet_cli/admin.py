"""The cluster admin's commands: `kvfleet get`, `describe`, `logs` — also `kubectl kvfleet ...`
(the `kubectl-kvfleet` executable is the same program, found by kubectl as a plugin).

kubectl's conventions: `-n/--namespace` (default: the kubeconfig context's), `-A`,
`-o table|wide|yaml|json`, `--kubeconfig`, `--context`; errors say what to do next and exit 1.
They read only (list and watch-free GETs); what they print is built in `views.py`.
"""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click
import yaml

from kvfleet_cli.completion import isvc_names
from kvfleet_cli.views import Json, describe, isvc_table, prefixed
from kvfleet_operator.kube import ISVC, POD, RESOURCES, Resource, api_status
from kvfleet_operator.render.common import COMPONENT_LABEL, ISVC_LABEL

F = TypeVar("F", bound=Callable[..., Any])
CHILDREN = [r for r in RESOURCES.values() if r.kind not in ("InferenceService", "Pod", "Event")]
"""What an InferenceService owns: the kinds the operator renders (its own table of them)."""
EVENT = RESOURCES[("v1", "Event")]
OPTIONAL_APIS = ("podmonitors", "leaderworkersets")
"""Children of APIs a cluster may not serve (listing them there is a 404)."""


def cluster_options(f: F) -> F:
    for option in reversed(
        [
            click.option("--kubeconfig", default=None, type=click.Path(dir_okay=False),
                         help="Kubeconfig (default: $KUBECONFIG, then ~/.kube/config)."),
            click.option("--context", default=None, help="Kubeconfig context."),
            click.option("-n", "--namespace", default=None,
                         help="Namespace (default: the context's, else default)."),
        ]
    ):  # fmt: skip
        f = option(f)
    return f


@dataclass
class Cluster:
    """A logged-in client and the namespace it works in."""

    kube: Any
    namespace: str

    @classmethod
    def connect(cls, kubeconfig: str | None, context: str | None, namespace: str | None) -> Cluster:
        from kubernetes.config import list_kube_config_contexts

        from kvfleet_operator.kube import Kube
        from kvfleet_operator.login import Credentials, LoginFailed, api_client

        try:
            kube = Kube(api_client(Credentials(kubeconfig=kubeconfig, context=context)))
        except LoginFailed as exc:
            raise click.ClickException(
                f"{exc}\n  (pass --kubeconfig, or set $KUBECONFIG)"
            ) from None
        if namespace is None:
            try:
                contexts, current = list_kube_config_contexts(  # type: ignore[no-untyped-call]
                    config_file=kubeconfig
                )
                chosen = next((c for c in contexts if c["name"] == context), current)
                namespace = (chosen or {}).get("context", {}).get("namespace")
            except Exception:  # in a pod, or an odd kubeconfig: the default namespace
                namespace = None
        return cls(kube, namespace or "default")

    def get(self, path: str, query: dict[str, str] | None = None) -> Json:
        from kubernetes.client.exceptions import ApiException

        try:
            result: Json = self.kube.request("GET", path, query=query)
        except ApiException as exc:
            raise click.ClickException(_api_error(exc)) from None
        except OSError as exc:  # refused, unreachable, TLS
            raise click.ClickException(f"cannot reach the API server: {exc}") from None
        return result

    def items(self, res: Resource, namespace: str | None, **query: str) -> list[Json]:
        out: list[Json] = self.get(res.path(namespace), dict(query) or None).get("items") or []
        return out

    def isvc(self, name: str) -> Json:
        """The InferenceService NAME in this namespace (a 404 says how to look elsewhere)."""
        return self.get(ISVC.path(self.namespace, name))

    def served(self, api_version: str) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            return bool(self.kube.served(api_version))
        except ApiException:
            return False


def _api_error(exc: Any) -> str:
    status = api_status(exc)
    message = status.get("message") or exc.reason
    hint = {
        401: "  (your credentials were refused: check the kubeconfig's user)",
        403: "  (ask an admin for it; check with `kubectl auth can-i list inferenceservices`)",
        404: "  (check the name and the namespace: -n NAMESPACE, or -A to look everywhere)",
    }.get(exc.status, "")
    return f"Error from server ({status.get('reason') or exc.status}): {message}{hint}"


def _emit(obj: Json | list[Json], output: str) -> None:
    if isinstance(obj, list):
        obj = {"apiVersion": "v1", "kind": "List", "items": obj, "metadata": {}}
    if output == "json":
        click.echo(json.dumps(obj, indent=2))
    else:
        click.echo(yaml.safe_dump(obj, sort_keys=False), nl=False)


@click.command("get")
@click.argument("name", required=False, shell_complete=isvc_names)
@cluster_options
@click.option("-A", "--all-namespaces", is_flag=True, help="Every namespace.")
@click.option("-o", "--output", type=click.Choice(["table", "wide", "yaml", "json"]),
              default="table", show_default=True)  # fmt: skip
def get(
    name: str | None,
    kubeconfig: str | None,
    context: str | None,
    namespace: str | None,
    all_namespaces: bool,
    output: str,
) -> None:
    """InferenceServices: model, replicas ready/active/warm, queue, KV cache, TTFT p99, age."""
    cluster = Cluster.connect(kubeconfig, context, namespace)
    ns = None if all_namespaces else cluster.namespace
    if name:
        if all_namespaces:
            raise click.UsageError("a NAME cannot be combined with -A")
        items = [cluster.isvc(name)]
    else:
        items = cluster.items(ISVC, ns)
    if output in ("yaml", "json"):
        _emit(items[0] if name else items, output)
        return
    if not items:
        where = "any namespace" if all_namespaces else f"{ns} namespace"
        click.echo(f"No InferenceServices found in {where}.", err=True)
        return
    now = datetime.datetime.now(datetime.UTC)
    click.echo(isvc_table(items, now, output == "wide", all_namespaces), nl=False)


@click.command("describe")
@click.argument("name", shell_complete=isvc_names)
@cluster_options
def describe_cmd(
    name: str, kubeconfig: str | None, context: str | None, namespace: str | None
) -> None:
    """One InferenceService: spec in brief, children and their health, pods and their roles,
    conditions, the autoscaler's last decision with its numbers, recent events."""
    cluster = Cluster.connect(kubeconfig, context, namespace)
    ns = cluster.namespace
    obj = cluster.isvc(name)
    selector = f"{ISVC_LABEL}={name}"
    children = []
    for res in CHILDREN:
        if res.plural in OPTIONAL_APIS and not cluster.served(res.api_version):
            continue  # only with the Prometheus Operator, or LeaderWorkerSet, installed
        for child in cluster.items(res, ns, labelSelector=selector):
            child["kind"] = res.kind  # a real API server leaves kind out of list items
            children.append(child)
    pods = cluster.items(POD, ns, labelSelector=selector)
    events = cluster.items(EVENT, ns, fieldSelector=f"involvedObject.name={name}")
    click.echo(describe(obj, children, pods, events, datetime.datetime.now(datetime.UTC)), nl=False)


@click.command("logs")
@click.argument("name", shell_complete=isvc_names)
@cluster_options
@click.option("--component", type=click.Choice(["engine", "gateway", "all"]), default="all",
              show_default=True, help="Whose pods.")  # fmt: skip
@click.option("--tail", type=int, default=-1, help="Last lines of each pod (default: all).")
@click.option("--previous", is_flag=True, help="The previous run of each container.")
def logs(
    name: str,
    kubeconfig: str | None,
    context: str | None,
    namespace: str | None,
    component: str,
    tail: int,
    previous: bool,
) -> None:
    """The logs of an InferenceService's pods, each line prefixed by its pod."""
    from kubernetes.client import CoreV1Api
    from kubernetes.client.exceptions import ApiException

    cluster = Cluster.connect(kubeconfig, context, namespace)
    ns = cluster.namespace
    cluster.isvc(name)  # it exists, or the error says how to find it
    selector = f"{ISVC_LABEL}={name}"
    if component != "all":
        selector += f",{COMPONENT_LABEL}={component}"
    pods = cluster.items(POD, ns, labelSelector=selector)
    if not pods:
        which = "" if component == "all" else f"{component} "
        raise click.ClickException(
            f"no {which}pods of {ns}/{name} yet (see: kvfleet describe {name} -n {ns})"
        )
    core = CoreV1Api(cluster.kube.api)
    failed = 0
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        pod_name = pod["metadata"]["name"]
        kwargs: dict[str, Any] = {"previous": previous}
        if tail >= 0:
            kwargs["tail_lines"] = tail
        try:
            text = core.read_namespaced_pod_log(pod_name, ns, **kwargs)
        except ApiException as exc:
            failed += 1
            click.echo(f"[pod/{pod_name}] {_api_error(exc)}", err=True)
            continue
        sys.stdout.write(prefixed(pod_name, text))
    if failed == len(pods):
        raise click.ClickException("no pod's log could be read")
