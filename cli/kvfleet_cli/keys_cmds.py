"""`kvfleet keys create|list|revoke|rotate`: the API-key Secret a gateway reads, in the cluster
(beside `keys new` and `keys hash`, which work offline).

The Secret holds `keys.yaml` (tenants and SHA-256 hashes, never a raw key). A new key is
printed once, on stdout, and only its hash is written. Each change is a read-modify-write
with the Secret's resourceVersion (a concurrent change is retried, never overwritten), and
the result is checked with the gateway's own parser before it is written. Gateways see the
change without a restart: the kubelet refreshes the mounted Secret and the gateway reloads
the file when its content changes.

Which Secret: `--secret NAME`, or `--service NAME` for the one an InferenceService's gateway
uses (`spec.gateway.apiKeysSecret`).

A Secret another tool keeps (`kubectl apply`'s last-applied-configuration, a server-side
apply by another manager such as Argo CD or Flux, a Helm release) is not changed unless
`--force` says so: re-applying its source would silently erase the keys written here.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import click
import yaml

from kvfleet_cli.admin import Cluster, cluster_options
from kvfleet_cli.gateway_cmds import keys
from kvfleet_cli.keys_view import service_config, tenant_rows, validate_text
from kvfleet_cli.views import table
from kvfleet_gateway.keys import KeyRing, hash_key, new_key
from kvfleet_kernel.schema import ConfigError

KEYS_KEY = "keys.yaml"
KEYS_MANAGER = "kvfleet-keys"
"""The field manager of these commands' writes."""
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
HELM_RELEASE = "meta.helm.sh/release-name"
Json = dict[str, Any]
Change = Callable[[list[Json]], str]
"""Edits the tenants list in place; returns what to tell the user."""


def _target(secret: str | None, service: str | None, login: dict[str, Any]) -> tuple[Cluster, str]:
    """The cluster to log in to, and the API-key Secret named by --secret or --service."""
    cluster = Cluster.connect(login["kubeconfig"], login["context"], login["namespace"])
    if secret is not None and service is None:
        return cluster, secret
    if service is None or secret is not None:
        raise click.UsageError("give exactly one of --secret NAME or --service NAME")
    obj = cluster.isvc(service)
    name = ((obj.get("spec") or {}).get("gateway") or {}).get("apiKeysSecret")
    if not name:
        raise click.ClickException(f"{service} has no gateway.apiKeysSecret (insecureNoAuth?)")
    return cluster, str(name)


def _tenants(secret: Json, where: str) -> list[Json]:
    data = (secret.get("data") or {}).get(KEYS_KEY)
    if data is None:
        return []
    doc = yaml.safe_load(base64.b64decode(data)) or {}
    if not isinstance(doc, dict) or not isinstance(doc.get("tenants", []), list):
        raise click.ClickException(f"{where}: {KEYS_KEY} is not a tenants document")
    tenants: list[Json] = doc.get("tenants") or []
    return tenants


def kept_elsewhere(secret: Json) -> str | None:
    """Which other tool keeps this Secret's content, if one does (its re-apply would erase
    what these commands write)."""
    meta = secret.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    if LAST_APPLIED in annotations:
        return "kubectl apply (its last-applied-configuration annotation)"
    if HELM_RELEASE in annotations:
        return f"the Helm release {annotations[HELM_RELEASE]!r}"
    for entry in meta.get("managedFields") or []:
        if entry.get("operation") == "Apply" and entry.get("manager") != KEYS_MANAGER:
            return f"a server-side apply by {entry.get('manager')!r}"
    return None


def _update(
    cluster: Cluster, name: str, change: Change, create: bool = False, force: bool = False
) -> str:
    """Read, change, check, write with the read resourceVersion; retry on a conflict."""
    from kubernetes.client.exceptions import ApiException

    path = f"/api/v1/namespaces/{cluster.namespace}/secrets/{name}"
    where = f"secret {cluster.namespace}/{name}"
    for _ in range(5):
        try:
            secret: Json | None = cluster.kube.request("GET", path)
        except ApiException as exc:
            if exc.status != 404 or not create:
                raise click.ClickException(f"{where}: {exc.reason} ({exc.status})") from None
            secret = None
        owner = None if secret is None or force else kept_elsewhere(secret)
        if owner is not None:
            raise click.ClickException(
                f"{where} is kept by {owner}: re-applying its source would erase the keys "
                "written here. Change the keys in that source (`kvfleet keys new` prints an "
                "entry), or pass --force to write here anyway."
            )
        tenants = _tenants(secret or {}, where)
        told = change(tenants)
        document = yaml.safe_dump({"tenants": tenants}, sort_keys=False)
        try:
            KeyRing.parse(yaml.safe_load(document), where)  # what the gateway will accept
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None
        encoded = base64.b64encode(document.encode()).decode()
        try:
            if secret is None:
                body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                        "metadata": {"name": name, "namespace": cluster.namespace},
                        "data": {KEYS_KEY: encoded}}  # fmt: skip
                cluster.kube.request(
                    "POST", f"/api/v1/namespaces/{cluster.namespace}/secrets", body,
                    query={"fieldManager": KEYS_MANAGER},
                )  # fmt: skip
            else:
                secret.setdefault("data", {})[KEYS_KEY] = encoded
                # (carries the resourceVersion read: a concurrent change is a 409)
                cluster.kube.request("PUT", path, secret, query={"fieldManager": KEYS_MANAGER})
        except ApiException as exc:
            if exc.status == 409:
                continue  # changed under us: read it again
            raise click.ClickException(f"{where}: {exc.reason} ({exc.status})") from None
        return told
    raise click.ClickException(f"{where} keeps changing; try again")


def _tenant(tenants: list[Json], name: str, create: bool) -> Json:
    for t in tenants:
        if t.get("name") == name:
            return t
    if not create:
        known = ", ".join(sorted(str(t.get("name")) for t in tenants)) or "none"
        raise click.ClickException(f"no tenant {name!r} (tenants: {known})")
    entry: Json = {"name": name, "keys": []}
    tenants.append(entry)
    return entry


def fingerprint(hashed: str) -> str:
    return hashed.removeprefix("sha256:")[:12]


def secret_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--service", default=None, help="The InferenceService whose keys.")(f)
    f = click.option("--secret", default=None, help="The API-key Secret.")(f)
    return cluster_options(f)


def write_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option(
        "--force",
        is_flag=True,
        help="Write even to a Secret that kubectl apply, a GitOps tool or Helm keeps.",
    )(f)
    return secret_options(f)


@keys.command("create")
@click.option("--tenant", required=True)
@write_options
def keys_create(
    tenant: str, secret: str | None, service: str | None, force: bool, **login: Any
) -> None:
    """Make a key for TENANT (added to the tenant, created if new); print it once."""
    cluster, name = _target(secret, service, login)
    raw = new_key()

    def add(tenants: list[Json]) -> str:
        _tenant(tenants, tenant, create=True).setdefault("keys", []).append(hash_key(raw))
        return f"key {fingerprint(hash_key(raw))} added to {tenant} in secret {name}"

    told = _update(cluster, name, add, create=True, force=force)
    click.echo(f"{told}; it is shown once, store it now:", err=True)
    click.echo(raw)


@keys.command("list")
@secret_options
def keys_list(secret: str | None, service: str | None, **login: Any) -> None:
    """Tenants, their key fingerprints and the limits in force, each with where it comes
    from (secret, spec tenant, defaults); an entry the gateway refuses is marked INVALID."""
    cluster, name = _target(secret, service, login)
    obj = cluster.get(f"/api/v1/namespaces/{cluster.namespace}/secrets/{name}")
    data = (obj.get("data") or {}).get(KEYS_KEY)
    doc = yaml.safe_load(base64.b64decode(data)) if data is not None else {}
    _tenants(obj, f"secret {name}")  # refuses what is not a tenants document at all
    rows = tenant_rows(doc, service_config(cluster, name, service), fingerprint)
    if not rows:
        click.echo(f"secret {cluster.namespace}/{name} has no tenants", err=True)
        return
    click.echo(table(["TENANT", "KEYS", "FINGERPRINTS", "LIMITS"], rows), nl=False)
    invalid = [r[0] for r in rows if r[3].startswith("INVALID")]
    if invalid:
        click.echo(
            f"secret {name}: a gateway refuses this file ({', '.join(invalid)}): it will not "
            "start with it, and a running one keeps its previous keys",
            err=True,
        )


@keys.command("validate")
@click.option("-f", "--filename", "path", required=True, type=click.File("r"),
              help="keys.yaml, or a manifest holding the keys Secret ('-': stdin).")  # fmt: skip
def keys_validate(path: Any) -> None:
    """Check a keys file with the gateway's own parser before applying it."""
    for line in validate_text(path.read(), path.name):
        click.echo(line)


@keys.command("revoke")
@click.option("--tenant", required=True)
@click.option("--key", "prefix", default=None, help="A fingerprint (or its prefix) to revoke.")
@click.option("--all", "revoke_all", is_flag=True, help="Every key of the tenant.")
@write_options
def keys_revoke(
    tenant: str,
    prefix: str | None,
    revoke_all: bool,
    secret: str | None,
    service: str | None,
    force: bool,
    **login: Any,
) -> None:
    """Remove one key (by fingerprint) or all of a tenant's keys."""
    if (prefix is None) == (not revoke_all):
        raise click.UsageError("give --key FINGERPRINT or --all")
    cluster, name = _target(secret, service, login)

    def revoke(tenants: list[Json]) -> str:
        entry = _tenant(tenants, tenant, create=False)
        held = list(entry.get("keys") or [])
        gone = held if revoke_all else [k for k in held if fingerprint(k).startswith(prefix or "")]
        if not gone:
            raise click.ClickException(f"{tenant} has no key {prefix!r} (kvfleet keys list)")
        if len(gone) > 1 and not revoke_all:
            raise click.ClickException(f"{prefix!r} matches {len(gone)} keys: give more of it")
        entry["keys"] = [k for k in held if k not in gone]
        return f"revoked {len(gone)} key(s) of {tenant} in secret {name}"

    click.echo(_update(cluster, name, revoke, force=force), err=True)


@keys.command("rotate")
@click.option("--tenant", required=True)
@write_options
def keys_rotate(
    tenant: str, secret: str | None, service: str | None, force: bool, **login: Any
) -> None:
    """A new key for TENANT replaces all its old ones, in one write; print it once."""
    cluster, name = _target(secret, service, login)
    raw = new_key()

    def rotate(tenants: list[Json]) -> str:
        entry = _tenant(tenants, tenant, create=False)
        old = len(entry.get("keys") or [])
        entry["keys"] = [hash_key(raw)]
        return f"{tenant}: {old} old key(s) replaced by {fingerprint(hash_key(raw))} in {name}"

    told = _update(cluster, name, rotate, force=force)
    click.echo(f"{told}; the new key is shown once, store it now:", err=True)
    click.echo(raw)
