"""`kvfleet render`, `kvfleet crds` and `kvfleet operator`."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

import click
import yaml

from kvfleet_cli.options import check_port_free
from kvfleet_kernel.schema import ConfigError, yaml_position
from kvfleet_operator.crd import (
    stale_chart_files,
    stale_files,
    write_chart_files,
    write_crds,
)
from kvfleet_operator.handlers import OperatorConfig
from kvfleet_operator.policy import Policy
from kvfleet_operator.render import Owner, owner_of, render_children
from kvfleet_operator.render.common import PREFILL
from kvfleet_operator.render.disaggregation import prefill_owner
from kvfleet_operator.render.engine import engine_args
from kvfleet_operator.scaling.autoscaler import AutoscalerConfig
from kvfleet_operator.spec import KIND

log = logging.getLogger("kvfleet.operator")
PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"


def _documents(path: Path) -> list[dict[str, Any]]:
    where = "stdin" if str(path) == "-" else str(path)
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
        docs = [d for d in yaml.safe_load_all(text) if d]
    except OSError as exc:
        raise click.ClickException(f"cannot read {where}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        at = yaml_position(exc)
        problem = getattr(exc, "problem", None) or "malformed"
        raise click.ClickException(
            f"{where}: invalid YAML{' at ' + at if at else ''}: {problem}"
        ) from exc
    if not docs:
        raise click.ClickException(f"{where}: no YAML documents (an empty file?)")
    for i, doc in enumerate(docs, 1):
        if not isinstance(doc, dict):
            raise click.ClickException(f"{where}: document {i} is not a mapping")
    return docs


def sglang_rejections(args: list[str]) -> str | None:
    """Parse an engine command line with SGLang's own argument parser (the `sglang` extra)."""
    import argparse
    import contextlib
    import io

    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError as exc:
        raise click.ClickException("--check needs SGLang: pip install 'kvfleet[sglang]'") from exc
    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(args)
    except (argparse.ArgumentError, SystemExit) as exc:
        return err.getvalue().strip() or str(exc)
    return None


def command_lines(owner: Owner) -> list[list[str]]:
    """The engine command line of each kind of pod, as the kubelet runs it: `$(VAR)`
    expanded with the values its environment would hold (LeaderWorkerSet's for a
    multi-node group: the leader, rank 0, and a worker, rank 1); a disaggregated service's
    prefill engine last."""
    leader = f"{owner.engine_name}-0.{owner.engine_name}.{owner.namespace}"
    pods = [(engine_args(owner.spec), rank) for rank in ((0, 1) if owner.multi_node else (0,))]
    if owner.spec.disaggregation is not None:
        pods.append((engine_args(prefill_owner(owner).spec, PREFILL), 0))
    lines = []
    for args, rank in pods:
        env = {"KVFLEET_ENGINE_API_KEY": "engine-key", "LWS_WORKER_INDEX": str(rank),
               "LWS_LEADER_ADDRESS": leader}  # fmt: skip
        lines.append([VARIABLE.sub(lambda m, env=env: env.get(m[1], m[0]), a) for a in args])  # type: ignore[misc]
    return lines


VARIABLE = re.compile(r"\$\((\w+)\)")
"""A container argument's `$(NAME)`, which the kubelet expands from the container's env."""


@click.command("render")
@click.option(
    "-f",
    "--filename",
    "path",
    required=True,
    type=click.Path(path_type=Path),
    help="YAML with InferenceServices ('-' for stdin).",
)
@click.option("--check", is_flag=True, help="Parse each engine command line with SGLang's parser.")
def render(path: Path, check: bool) -> None:
    """Print the child manifests of every InferenceService in FILE, as YAML."""
    out: list[dict[str, Any]] = []
    failed = False
    for doc in _documents(path):
        if doc.get("kind") != KIND:
            click.echo(
                f"# skipped {doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}", err=True
            )
            continue
        doc.setdefault("metadata", {}).setdefault("uid", PLACEHOLDER_UID)
        name = doc["metadata"].get("name", "?")
        try:
            owner = owner_of(doc)
            children = render_children(owner)
        except (ConfigError, KeyError) as exc:
            click.echo(f"Error: {KIND} {name}: {exc}", err=True)
            failed = True
            continue
        if check:
            problem = next(filter(None, (sglang_rejections(a) for a in command_lines(owner))), None)
            if problem:
                click.echo(
                    f"Error: {KIND} {name}: SGLang rejects the command line: {problem}", err=True
                )
                failed = True
            else:
                click.echo(f"# {name}: SGLang accepts the engine command line", err=True)
        out += children
    click.echo(yaml.safe_dump_all(out, sort_keys=False), nl=False)
    if failed:
        sys.exit(1)


@click.command("crds")
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), default=Path("crds"), show_default=True
)
@click.option(
    "--chart",
    type=click.Path(path_type=Path),
    default=None,
    help="The Helm chart that gets copies in its crds/ and files/ (default: charts/kvfleet"
    " beside --out).",
)
@click.option(
    "--manifests",
    type=click.Path(path_type=Path),
    default=None,
    help="The kustomize manifests the chart's files/ copy (default: manifests beside --out).",
)
@click.option("--check", is_flag=True, help="Exit 1 if the files differ from the spec model.")
def crds(out_dir: Path, chart: Path | None, manifests: Path | None, check: bool) -> None:
    """Write the InferenceService CRD generated from the spec model, and the Helm chart's
    copies of it and of the manifests its templates read."""
    chart = chart or out_dir.parent / "charts" / "kvfleet"
    manifests = manifests or out_dir.parent / "manifests"
    if not manifests.is_dir():
        raise click.UsageError(f"no {manifests}: give --manifests (and --chart)")
    if check:
        stale = [str(out_dir / n) for n in stale_files(out_dir)]
        stale += [str(chart / n) for n in stale_chart_files(chart, manifests)]
        if stale:
            raise click.ClickException(f"stale: {', '.join(stale)}; run `make crds`")
        click.echo(f"{out_dir} and {chart} are current")
        return
    for path in [*write_crds(out_dir), *write_chart_files(chart, manifests)]:
        click.echo(f"wrote {path}")


REFERENCES = {
    "crd-reference.md": (
        "InferenceService reference",
        "Every field of `kvfleet.dev/v1alpha1` InferenceService `.spec`, as the CRD in `crds/`"
        " declares it (`kubectl explain kis.spec` shows the same text).",
    ),
    "inferencegateway-reference.md": (
        "InferenceGateway reference",
        "Every field of `kvfleet.dev/v1alpha1` InferenceGateway `.spec`: one gateway for the"
        " InferenceServices of its namespace that name it in `spec.gateway.inferenceGateway`"
        " (`kubectl explain kig.spec`).",
    ),
    "gateway-config.md": (
        "Gateway configuration reference",
        "The document `kvfleet gateway --config FILE` reads; the operator renders it into the"
        " gateway's ConfigMap. The tenant limits are the same model as the CRD's"
        " `spec.gateway.defaultLimits`.",
    ),
}


def references() -> dict[str, str]:
    from kvfleet_gateway.config import GatewayConfig
    from kvfleet_kernel.schema_docs import reference
    from kvfleet_operator.gateway_spec import InferenceGatewaySpec
    from kvfleet_operator.spec import InferenceServiceSpec

    models: dict[str, tuple[type, str]] = {
        "crd-reference.md": (InferenceServiceSpec, "spec"),
        "inferencegateway-reference.md": (InferenceGatewaySpec, "spec"),
        "gateway-config.md": (GatewayConfig, ""),
    }
    return {
        name: reference(models[name][0], title, intro, models[name][1])
        for name, (title, intro) in REFERENCES.items()
    }


@click.command("docs")
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), default=Path("docs"), show_default=True
)
@click.option("--check", is_flag=True, help="Exit 1 if the files differ from the models.")
def docs(out_dir: Path, check: bool) -> None:
    """Write the CRD and gateway-config references generated from their typed models."""
    stale = []
    for name, text in references().items():
        path = out_dir / name
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        click.echo(f"wrote {path}")
    if stale:
        raise click.ClickException(f"stale in {out_dir}: {', '.join(stale)}; run `make docs`")
    if check:
        click.echo(f"{out_dir} is current")


def _allow_list(values: tuple[str, ...]) -> tuple[str, ...] | None:
    """A repeatable allow-list flag: not given, any; `-`, none; else the values given."""
    if not values:
        return None
    return tuple(v for v in values if v != "-")


@click.command("operator")
@click.option(
    "--namespace",
    "-n",
    "namespaces",
    multiple=True,
    help="Watch only these (repeatable); default: all.",
)
@click.option(
    "--kubeconfig",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="Kubeconfig outside a cluster (default: in-cluster, else $KUBECONFIG or ~/.kube/config).",
)
@click.option("--context", default=None, help="Kubeconfig context (default: its current-context).")
@click.option(
    "--resync",
    "resync_s",
    type=float,
    default=OperatorConfig.resync_s,
    show_default=True,
    help="Seconds between full reconciles.",
)
@click.option(
    "--prometheus-url",
    default=None,
    help="Read the autoscaler's signals from this Prometheus (default: scrape the pods).",
)
@click.option(
    "--prometheus-timeout",
    "prometheus_timeout_s",
    type=float,
    default=AutoscalerConfig.prometheus_timeout_s,
    show_default=True,
    help="Seconds a Prometheus query may take.",
)
@click.option(
    "--prometheus-rate-window",
    default=AutoscalerConfig.prometheus_rate_window,
    show_default=True,
    callback=lambda _ctx, _param, value: _prometheus_duration(value),
    help="rate() window of the arrival rate and the SLO's TTFT quantile (>= 4 scrape intervals).",
)
@click.option(
    "--prometheus-insecure-skip-tls-verify",
    is_flag=True,
    help="Do not verify an https Prometheus's certificate.",
)
@click.option(
    "--api-timeout",
    "api_timeout_s",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds an API server request may take (connect and read).",
)
@click.option(
    "--scale-interval",
    "scale_interval_s",
    type=float,
    default=AutoscalerConfig.interval_s,
    show_default=True,
    help="Seconds between two autoscaling decisions.",
)
@click.option(
    "--metrics-port",
    type=int,
    default=8081,
    show_default=True,
    help="Serve the operator's Prometheus metrics on this port (0: not served); a port in use"
    " is refused at start.",
)
@click.option(
    "--liveness",
    "liveness",
    default=None,
    help="Serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz.",
)
@click.option(
    "--stall-after",
    "stall_s",
    type=click.FloatRange(min=1),
    default=OperatorConfig.stall_s,
    show_default=True,
    help="Seconds without a successful reconcile while work is pending (or without a"
    " completed autoscaler tick) after which the liveness probe fails.",
)
@click.option(
    "--operator-namespace",
    envvar="OPERATOR_NAMESPACE",
    default=OperatorConfig.operator_namespace,
    show_default=True,
    help="The operator's own namespace ($OPERATOR_NAMESPACE: the manifests set it from the"
    " downward API); the NetworkPolicies admit its metrics reads from there.",
)
@click.option(
    "--gateway-image",
    envvar="KVFLEET_IMAGE",
    default=OperatorConfig.gateway_image,
    show_default=True,
    help="The gateways' image where a spec names none: the operator's own ($KVFLEET_IMAGE:"
    " the chart and manifests/ set it to the image they run the operator with).",
)
@click.option(
    "--allowed-image-prefix",
    "image_prefixes",
    multiple=True,
    help="Policy: engine and gateway images a spec sets must come from this registry or"
    " repository, or be this exact reference (repeatable; default: any).",
)
@click.option(
    "--require-image-digest",
    is_flag=True,
    help="Policy: images a spec sets must be pinned by digest (@sha256:...).",
)
@click.option(
    "--allowed-toleration-key",
    "toleration_keys",
    multiple=True,
    help="Policy: taint keys tolerations may name (repeatable; default: any). `-` allows none.",
)
@click.option(
    "--allowed-priority-class",
    "priority_classes",
    multiple=True,
    help="Policy: PriorityClasses engine pods may use (repeatable; default: any). `-` allows none.",
)
@click.option(
    "--forbid-insecure-no-auth",
    is_flag=True,
    help="Policy: refuse gateways that serve without API keys (gateway.insecureNoAuth).",
)
@click.option(
    "--forbid-external-services",
    is_flag=True,
    help="Policy: refuse LoadBalancer and NodePort gateway Services.",
)
@click.option("--log-level", default="info", show_default=True)
def operator(
    namespaces: tuple[str, ...],
    kubeconfig: str | None,
    context: str | None,
    resync_s: float,
    prometheus_url: str | None,
    prometheus_timeout_s: float,
    prometheus_rate_window: str,
    prometheus_insecure_skip_tls_verify: bool,
    api_timeout_s: float,
    scale_interval_s: float,
    metrics_port: int,
    liveness: str | None,
    stall_s: float,
    operator_namespace: str,
    gateway_image: str,
    image_prefixes: tuple[str, ...],
    require_image_digest: bool,
    toleration_keys: tuple[str, ...],
    priority_classes: tuple[str, ...],
    forbid_insecure_no_auth: bool,
    forbid_external_services: bool,
    log_level: str,
) -> None:
    """Run the operator: reconcile InferenceServices into SGLang fleets and gateways, and
    autoscale them on queue depth and KV-cache usage."""
    from kvfleet_operator.handlers import Controller, run
    from kvfleet_operator.kube import Kube
    from kvfleet_operator.login import Credentials, LoginFailed, api_client

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if log_level.lower() != "debug":  # kopf reports every handled event at INFO
        logging.getLogger("kopf").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # liveness probes
    if metrics_port:  # kopf would retry the bind every minute, reconciling nothing
        check_port_free("0.0.0.0", metrics_port, "--metrics-port", None)
    credentials = Credentials(kubeconfig=kubeconfig, context=context)
    config = OperatorConfig(
        liveness_endpoint=liveness,
        stall_s=stall_s,
        operator_namespace=operator_namespace,
        gateway_image=gateway_image,
        metrics_port=metrics_port or None,
        namespaces=namespaces,
        resync_s=resync_s,
        policy=Policy(
            allowed_image_prefixes=image_prefixes,
            require_image_digest=require_image_digest,
            allowed_toleration_keys=_allow_list(toleration_keys),
            allowed_priority_classes=_allow_list(priority_classes),
            allow_insecure_no_auth=not forbid_insecure_no_auth,
            allow_external_service=not forbid_external_services,
        ),
        credentials=credentials,
        autoscaler=AutoscalerConfig(
            prometheus_url=prometheus_url,
            interval_s=scale_interval_s,
            prometheus_timeout_s=prometheus_timeout_s,
            prometheus_verify_tls=not prometheus_insecure_skip_tls_verify,
            prometheus_rate_window=prometheus_rate_window,
        ),
    )
    try:
        kube = Kube(api_client(credentials), timeout_s=api_timeout_s)
    except LoginFailed as exc:
        raise click.ClickException(str(exc)) from exc
    log.info("logging in to %s", kube.api.configuration.host)
    run(Controller(kube, config))


def _prometheus_duration(value: str) -> str:
    """A Prometheus range duration (`30s`, `1m`, `1h30m`), else a usage error."""
    if not re.fullmatch(r"(\d+(ms|s|m|h|d|w|y))+", value):
        raise click.BadParameter(f"{value!r} is not a Prometheus duration (e.g. 30s, 1m, 2m30s)")
    return value
