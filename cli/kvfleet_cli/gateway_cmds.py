"""`kvfleet gateway`, `kvfleet keys`, `kvfleet budgets` and `kvfleet fetch-tokenizer`: run the
gateway; make and hash API keys; accept a budget-store data loss; fetch the tokenizer the
gateway hashes prompts with (prefixIndex: events)."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import sys
from pathlib import Path
from typing import Any

import click
import yaml

from kvfleet_cli.options import check_port_free, use_uvloop
from kvfleet_gateway import serving
from kvfleet_gateway.app import make_app
from kvfleet_gateway.config import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    ConfigError,
    GatewayConfig,
    LimitsConfig,
    Listen,
    PrefillBackends,
    load_config,
)
from kvfleet_gateway.keys import hash_key, new_key
from kvfleet_gateway.kv_events.hub import HubError
from kvfleet_gateway.kv_events.hub import fetch_tokenizer as fetch_from_hub


@click.command("gateway")
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Gateway config YAML (what the operator renders; reference: docs/gateway-config.md).",
)
@click.option(
    "--backend", "backends", multiple=True, help="Quick mode: an engine URL (repeatable)."
)
@click.option(
    "--prefill",
    "prefills",
    multiple=True,
    help="Quick mode, disaggregated: a prefill engine URL (repeatable); --backend URLs are"
    " then the decode engines.",
)
@click.option(
    "--bootstrap-port",
    type=int,
    default=PrefillBackends.bootstrap_port,
    show_default=True,
    help="Quick mode: the prefill engines' --disaggregation-bootstrap-port.",
)
@click.option(
    "--host", default=None, help=f"Listen address (default {Listen.host}); overrides listen.host."
)
@click.option(
    "--port", type=int, default=None, help=f"Port (default {Listen.port}); overrides listen.port."
)
@click.option(
    "--metrics-port",
    type=int,
    default=None,
    help=f"Port of /metrics (default {Listen.metrics_port}); overrides listen.metricsPort.",
)
@click.option(
    "--policy",
    type=click.Choice(POLICY_NAMES),
    default=DEFAULT_POLICY,
    show_default=True,
    help="Quick mode: routing.policy.",
)
@click.option(
    "--keys",
    "keys_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Quick mode: auth.keysFile (see `kvfleet keys new`).",
)
@click.option(
    "--store",
    default=LimitsConfig.store,
    show_default=True,
    help="Quick mode: limits.store, 'memory' or a redis:// URL.",
)
@click.option(
    "--engine-api-key-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Quick mode: backends.engineApiKeyFile, the engines' --api-key.",
)
@click.option("--insecure-no-auth", is_flag=True, help="Serve without API keys (testing only).")
@click.option("--log-level", default="info", show_default=True)
def gateway(
    config_file: Path | None,
    backends: tuple[str, ...],
    prefills: tuple[str, ...],
    bootstrap_port: int,
    host: str | None,
    port: int | None,
    metrics_port: int | None,
    policy: str,
    keys_file: Path | None,
    store: str,
    engine_api_key_file: Path | None,
    insecure_no_auth: bool,
    log_level: str,
) -> None:
    """Run the token-aware gateway (auth, limits, budgets, routing, streaming proxy)."""
    logging.basicConfig(level=log_level.upper(), format="%(message)s", stream=sys.stderr)
    try:
        if config_file is not None:
            if backends:
                raise click.UsageError("give --config or --backend, not both")
            config = load_config(config_file)
        elif backends:
            if keys_file is None and not insecure_no_auth:
                raise click.UsageError(
                    "no API keys configured: pass --keys FILE (see `kvfleet keys new`) or, "
                    "for local testing only, --insecure-no-auth"
                )
            auth = {"keysFile": str(keys_file)} if keys_file else {"insecureNoAuth": True}
            engine_key = {"engineApiKeyFile": str(engine_api_key_file)}
            config = GatewayConfig.from_dict(
                {
                    "backends": {
                        "static": list(backends),
                        **(engine_key if engine_api_key_file else {}),
                        **(_prefill_pool(prefills, bootstrap_port) if prefills else {}),
                    },
                    "routing": {"policy": policy},
                    "auth": auth,
                    "limits": {"store": store},
                }
            )
        else:
            raise click.UsageError("give --config FILE or at least one --backend URL")
        listen = dataclasses.replace(  # the flags override; the rest of `listen` stays
            config.listen,
            host=host or config.listen.host,
            port=port or config.listen.port,
            metrics_port=metrics_port or config.listen.metrics_port,
        )
        config = dataclasses.replace(config, listen=listen)
        app = make_app(config)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    check_port_free(listen.host, listen.port, "--port", "listen.port")
    check_port_free(listen.host, listen.metrics_port, "--metrics-port", "listen.metricsPort")
    click.echo(
        f"kvfleet gateway on http://{listen.host}:{listen.port} (metrics on :"
        f"{listen.metrics_port}) → {_fronts(config)}",
        err=True,
    )
    use_uvloop()
    # SIGTERM: stop accepting, let requests in flight finish for timeouts.drain, then cut.
    # A client that sent half a body gets its 408, then aiohttp keeps draining the rest for
    # lingering_time (aiohttp#1800); one second is plenty for a well-behaved client.
    try:
        serving.run(app, listen.host, listen.port, config.timeouts.drain, lingering_time=1.0)
    except OSError as exc:  # taken between the check above and the bind
        if exc.errno != errno.EADDRINUSE:
            raise
        raise click.ClickException(
            f"cannot listen: {exc.strerror} (ports {listen.port} and {listen.metrics_port}:"
            " choose others with --port and --metrics-port)"
        ) from None


@click.group("keys")
def keys() -> None:
    """API keys: only their SHA-256 hashes are ever stored."""


@keys.command("new")
@click.option("--tenant", required=True, help="Tenant name for the keys-file entry.")
def keys_new(tenant: str) -> None:
    """Make a random key; print it once (stderr) and its keys-file entry (stdout)."""
    raw = new_key()
    click.echo(f"API key for {tenant} (shown once, store it now): {raw}", err=True)
    click.echo(
        yaml.safe_dump({"tenants": [{"name": tenant, "keys": [hash_key(raw)]}]}, sort_keys=False),
        nl=False,
    )


@keys.command("hash")
@click.argument("key", required=False)
def keys_hash(key: str | None) -> None:
    """Print `sha256:<hex>` for KEY (or for a key read from stdin, safer than argv)."""
    raw = key if key is not None else sys.stdin.readline().strip()
    if not raw:
        raise click.UsageError("no key given")
    click.echo(hash_key(raw))


@click.group("budgets")
def budgets() -> None:
    """Token budgets kept in Redis."""


@budgets.command("reset")
@click.option("--store", required=True, help="The gateways' limits.store, a redis:// URL.")
@click.option("--tenant", default=None, help="Only this tenant (default: every lost tenant).")
@click.option(
    "--scope",
    default="",
    help="The gateways' limits.scope (an InferenceService's: <namespace>/<name>); default:"
    " every scope.",
)
@click.option(
    "--password-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A file holding the Redis password (the gateways' limits.passwordFile).",
)
def budgets_reset(store: str, tenant: str | None, scope: str, password_file: Path | None) -> None:
    """Accept a lost budget store: after Redis restarted without its data, gateways refuse
    budgeted requests (503) until its data is restored, or until this command starts the
    lost tenants' budgets again from zero."""
    from redis.exceptions import RedisError

    from kvfleet_gateway.backends import read_secret_file
    from kvfleet_gateway.redis_store import reset_lost_budgets

    if not store.startswith(("redis://", "rediss://", "unix://")):
        raise click.UsageError("--store must be a redis:// URL")
    try:
        password = read_secret_file(
            str(password_file) if password_file else None, "--password-file"
        )
        reset = asyncio.run(reset_lost_budgets(store, tenant, scope, password))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    except RedisError as exc:
        raise click.ClickException(f"cannot reach {store}: {exc.__class__.__name__}") from None
    if not reset:
        click.echo("no tenant's budget is marked lost; nothing changed")
        return
    for name in reset:
        click.echo(f"budget of tenant {name} starts again from zero")


@click.command("fetch-tokenizer")
@click.argument("repo")
@click.option("--revision", default=None, help="Branch, tag or commit (default: main).")
@click.option(
    "--dest",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Directory to write tokenizer.json (and tokenizer_config.json, chat_template.jinja).",
)
def fetch_tokenizer(repo: str, revision: str | None, dest: Path) -> None:
    """Download REPO's tokenizer from the Hugging Face Hub (HF_ENDPOINT, HF_TOKEN honoured)."""
    try:
        written = asyncio.run(fetch_from_hub(repo, dest, revision))
    except (HubError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{repo}: wrote {', '.join(written)} to {dest}", err=True)


def _prefill_pool(urls: tuple[str, ...], bootstrap_port: int) -> dict[str, Any]:
    """Quick mode's `backends.prefill` (disaggregated serving)."""
    return {"prefill": {"static": [{"url": u} for u in urls], "bootstrapPort": bootstrap_port}}


def _fronts(config: GatewayConfig) -> str:
    """What the start-up line says the gateway fronts."""
    if config.backends is None:
        pools = f"{len(config.pools)} pool(s)"
        return pools + (f" and those of {config.pools_file}" if config.pools_file else "")
    return f"{len(config.backends.static)} static backend(s), policy {config.routing.policy}"
