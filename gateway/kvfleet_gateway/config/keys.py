"""The API-key file's schema and its checks, beside the gateway config: the gateway reads
the file with it, the operator checks the Secret it mounts with it, and the CLI checks a
file before it is applied — one parser, so all three agree on what a gateway accepts."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvfleet_gateway.config.limits import Limits
from kvfleet_kernel.schema import ConfigError, fld, parse

KEY_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True, kw_only=True)
class KeysFileTenant:
    name: str = fld(doc="Tenant name; the gateway config's limits.tenants refer to it.")
    keys: tuple[str, ...] = fld((), "SHA-256 hashes of the tenant's keys: sha256:<64 hex>.")
    limits: Limits | None = fld(None, "Overrides of the config's limits for this tenant.")


@dataclass(frozen=True, kw_only=True)
class KeysFile:
    """The API-key file (`keys.yaml` in the Secret): tenants and hashes, never raw keys."""

    tenants: tuple[KeysFileTenant, ...] = fld((), "Tenants and their key hashes.")


def parse_keys_file(doc: Any, origin: str = "keys file") -> KeysFile:
    """The keys document as a gateway accepts it; a ConfigError names `origin` and the field
    (`tenants[0].limits.requestPerMinute: unknown field`)."""
    try:
        keys_file = parse(KeysFile, doc)
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc.path}", exc.message) from exc
    names: set[str] = set()
    for i, t in enumerate(keys_file.tenants):
        if t.name in names:
            raise ConfigError(f"{origin}: tenants[{i}].name", f"{t.name!r} appears twice")
        names.add(t.name)
        for j, key in enumerate(t.keys):
            if not KEY_HASH.match(key):
                # Never echo the value: it may be a raw key pasted by mistake.
                raise ConfigError(
                    f"{origin}: tenants[{i}].keys[{j}]",
                    "expected 'sha256:<64 hex digits>' (store hashes, not keys)",
                )
    return keys_file


def tenant_problems(doc: Any) -> dict[int, str]:
    """Each tenant entry of a keys document that a gateway would refuse, by index, with the
    reason (`limits.requestPerMinute: unknown field`): what a listing marks."""
    tenants = doc.get("tenants") if isinstance(doc, dict) else None
    out: dict[int, str] = {}
    for i, entry in enumerate(tenants if isinstance(tenants, list) else []):
        try:
            parse_keys_file({"tenants": [entry]}, "")
        except ConfigError as exc:
            out[i] = f"{exc.path.removeprefix(': tenants[0].')}: {exc.message}"
    return out
