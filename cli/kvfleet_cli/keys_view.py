"""What `kvfleet keys list` and `kvfleet keys validate` show: each tenant's limits in force
and where each comes from, and the entries a gateway would refuse.

The gateway resolves a tenant's limits in one order (`GatewayConfig.limits_for`): its
config's defaults (the InferenceService's `spec.gateway.defaultLimits`), then the config's
tenant entry (`spec.gateway.tenants[]`), then the keys Secret's entry; a field set later
wins. The listing reads the config the gateway itself reads (its ConfigMap) and applies that
same function, so what it shows is what the gateway enforces.
"""

from __future__ import annotations

import base64
from typing import Any

import click
import yaml

from kvfleet_cli.admin import Cluster
from kvfleet_gateway.config import (
    ConfigError,
    GatewayConfig,
    Limits,
    parse_keys_file,
    tenant_problems,
)
from kvfleet_kernel.schema import parse, to_json
from kvfleet_operator.render.gateway import CONFIG_KEY, KEYS_KEY

Json = dict[str, Any]
SOURCES = ("secret", "spec tenant", "defaults")
"""Where a limit comes from, latest first: the order a gateway overrides them in."""


def service_config(cluster: Cluster, secret: str, service: str | None) -> GatewayConfig | None:
    """The gateway config of the InferenceService whose keys these are (`--service`, or the
    one service of the namespace naming this Secret); None when none or several do."""
    if service is None:
        items = cluster.get(f"/apis/kvfleet.dev/v1alpha1/namespaces/{cluster.namespace}"
                            "/inferenceservices").get("items") or []  # fmt: skip
        users = [
            i["metadata"]["name"]
            for i in items
            if ((i.get("spec") or {}).get("gateway") or {}).get("apiKeysSecret") == secret
        ]
        if len(users) != 1:
            return None
        service = users[0]
    path = f"/api/v1/namespaces/{cluster.namespace}/configmaps/{service}-gateway"
    try:
        text = (cluster.get(path).get("data") or {}).get(CONFIG_KEY)
    except click.ClickException:  # no such ConfigMap (a shared InferenceGateway's keys)
        return None
    if text is None:
        return None
    try:
        return GatewayConfig.from_dict(yaml.safe_load(text))
    except ConfigError:
        return None


def _amount(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


WORDS: dict[str, str] = {
    "requestsPerMinute": "{} requests/min",
    "tokensPerMinute": "{} tokens/min",
    "maxConcurrent": "{} concurrent",
    "maxTokens": "max_tokens <= {}",
    "defaultMaxTokens": "default max_tokens {}",
}


def limit_text(key: str, value: Any) -> str:
    """One limit in words: `60 requests/min`, `1,000,000 tokens / 1d budget`."""
    if key == "tokenBudget" and isinstance(value, dict):
        return f"{_amount(value.get('tokens'))} tokens / {value.get('period', '30d')} budget"
    if key == "costBudget" and isinstance(value, dict):
        return f"{value.get('amount')} cost / {value.get('period', '30d')} budget"
    if key in WORDS:
        return WORDS[key].format(_amount(value))
    return f"{key}: {value}"


def in_force(config: GatewayConfig | None, tenant: str, key_limits: Limits | None) -> str:
    """The tenant's limits as the gateway enforces them, each with its source:
    `60 requests/min (secret), 128 concurrent (spec tenant), max_tokens <= 4,096 (defaults)`.
    Without the service's config, only the Secret's, and that the rest is unknown."""
    if config is None:
        own = to_json(key_limits) if key_limits is not None else {}
        said = ", ".join(f"{limit_text(k, v)} (secret)" for k, v in own.items())
        return (said + "; " if said else "") + "the rest: the service's (give --service)"
    spec_tenant = next((t.limits for t in config.limits.tenants if t.name == tenant), None)
    layers = (key_limits, spec_tenant, config.limits.defaults)
    parts = []
    for key, value in to_json(config.limits_for(tenant, key_limits)).items():
        source = next(
            name
            for name, layer in zip(SOURCES, layers, strict=True)
            if layer is not None and to_json(layer).get(key) == value
        )
        parts.append(f"{limit_text(key, value)} ({source})")
    return ", ".join(parts) or "unlimited"


def tenant_rows(doc: Any, config: GatewayConfig | None, fingerprint: Any) -> list[list[str]]:
    """One row per tenant entry: name, key count, fingerprints, limits in force — or, for an
    entry a gateway would refuse, INVALID and the field."""
    tenants = doc.get("tenants") if isinstance(doc, dict) else None
    problems = tenant_problems(doc)
    rows = []
    for i, entry in enumerate(tenants if isinstance(tenants, list) else []):
        entry = entry if isinstance(entry, dict) else {}
        name, keys = str(entry.get("name")), [str(k) for k in entry.get("keys") or []]
        if i in problems:
            limits = f"INVALID {problems[i]}"
        else:
            raw = entry.get("limits")
            limits = in_force(config, name, parse(Limits, raw) if raw is not None else None)
        prints = " ".join(fingerprint(k) for k in keys) or "<none>"
        rows.append([name, str(len(keys)), prints, limits])
    return rows


def _keys_documents(text: str, origin: str) -> list[tuple[str, Any]]:
    """The keys documents of a file: `keys.yaml` itself, or each Secret of a manifest (its
    stringData or data `keys.yaml`), with where each came from."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError:
        raise click.ClickException(f"{origin}: not a YAML document") from None
    secrets = [d for d in docs if isinstance(d, dict) and d.get("kind") == "Secret"]
    if not secrets:
        return [(origin, docs[0] if len(docs) == 1 else docs)]
    out = []
    for secret in secrets:
        where = f"{origin}: secret {(secret.get('metadata') or {}).get('name')} {KEYS_KEY}"
        if (raw := (secret.get("stringData") or {}).get(KEYS_KEY)) is None:
            encoded = (secret.get("data") or {}).get(KEYS_KEY)
            raw = base64.b64decode(encoded).decode(errors="replace") if encoded else None
        if raw is None:
            raise click.ClickException(f"{where}: missing")
        try:
            out.append((where, yaml.safe_load(raw)))
        except yaml.YAMLError:
            raise click.ClickException(f"{where}: not a YAML document") from None
    return out


def validate_text(text: str, origin: str) -> list[str]:
    """What a gateway would say of each keys document in `text`: a summary each, or a
    ClickException naming the field it refuses."""
    said = []
    for where, doc in _keys_documents(text, origin):
        try:
            keys_file = parse_keys_file(doc, where)
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None
        count = sum(len(t.keys) for t in keys_file.tenants)
        said.append(f"{where}: valid ({len(keys_file.tenants)} tenants, {count} keys)")
    return said
