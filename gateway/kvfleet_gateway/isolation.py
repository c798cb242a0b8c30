"""The cache salt a request is sent with: which prefix-cache namespace it reads and fills.

SGLang (0.5.23: `cache_salt` on chat, completions and /generate) keeps a radix root per
salt, so a prompt reuses only prefixes cached under its own salt, and it names a salted
namespace's pages by a hash chain seeded from the salt (`kv_events.hashing`). The gateway
derives the salt from the tenant (or its group, `cacheIsolation.groups`) and from any salt
the client sent, which splits the tenant's namespace further but can never reach another's:
the parts are hashed with their lengths, so no client salt spells another tenant's salt.
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvfleet_gateway.config import CacheIsolation
from kvfleet_gateway.errors import bad_request

MAX_CLIENT_SALT = 256


def cache_salt(config: CacheIsolation, tenant: str, client_salt: Any) -> str | None:
    """The salt to forward (None: none, the shared namespace)."""
    if client_salt is not None and (
        not isinstance(client_salt, str) or len(client_salt) > MAX_CLIENT_SALT
    ):
        raise bad_request(
            f"'cache_salt' must be a string of at most {MAX_CLIENT_SALT} characters", "cache_salt"
        )
    if config.mode == "shared":
        return client_salt or None
    group = next((g.name for g in config.groups if tenant in g.tenants), None)
    space = f"group:{group}" if group is not None else f"tenant:{tenant}"
    digest = hashlib.sha256(b"kvfleet-cache-namespace-v1")
    for part in (space, client_salt or ""):
        data = part.encode()
        digest.update(len(data).to_bytes(8, "little") + data)
    return "kvf-" + digest.hexdigest()[:32]


def salted_units(salt: str | None, text: str) -> str:
    """The prompt text as a text-prefix index keys it: salted prompts under their salt."""
    return text if salt is None else f"\x00{salt}\x00{text}"
