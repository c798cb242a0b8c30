"""API keys: tenants and their SHA-256 key hashes, read from a file that may change in place.

    tenants:
      - name: team-a
        keys: ["sha256:9f86d08..."]          # sha256 of the raw key, hex
        limits: {requestsPerMinute: 600, tokenBudget: {tokens: 1000000, period: 1d}}

Raw keys are never stored, logged or exported. A presented key is hashed and compared with
every stored hash in constant time (no early exit), so timing reveals neither which tenant
nor how much of a hash matched. The file is polled; a Kubernetes Secret volume swaps it
atomically through a symlink, and a file that fails to parse keeps the previous keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvfleet_gateway.config import ConfigError, KeysFile, KeysFileTenant, Limits, parse_keys_file
from kvfleet_gateway.tasks import every
from kvfleet_kernel.schema import yaml_position

log = logging.getLogger("kvfleet.gateway.keys")

__all__ = ["KeyRing", "KeysFile", "KeysFileTenant", "Tenant", "hash_key", "new_key"]


def hash_key(raw: str) -> str:
    return "sha256:" + hashlib.sha256(raw.encode()).hexdigest()


def new_key() -> str:
    """A random API key (256 bits); only its `hash_key` is ever stored."""
    return "kvf-" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: Limits | None


@dataclass(frozen=True)
class KeyRing:
    entries: tuple[tuple[bytes, Tenant], ...]
    """(hash bytes, tenant) for every key."""

    @staticmethod
    def parse(doc: Any, origin: str = "keys file") -> KeyRing:
        entries: list[tuple[bytes, Tenant]] = []
        for t in parse_keys_file(doc, origin).tenants:
            tenant = Tenant(t.name, t.limits)
            entries.extend((key.encode(), tenant) for key in t.keys)
        return KeyRing(tuple(entries))

    def authenticate(self, raw_key: str) -> Tenant | None:
        presented = hash_key(raw_key).encode()
        found: Tenant | None = None
        for stored, tenant in self.entries:
            if hmac.compare_digest(presented, stored) and found is None:
                found = tenant
        return found

    def tenant(self, name: str) -> Tenant | None:
        return next((t for _, t in self.entries if t.name == name), None)


def load_keyring(path: Path) -> KeyRing:
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"keys file {path}", f"cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        # Only the position: PyYAML's message quotes the offending line, which may hold a key.
        where = yaml_position(exc)
        raise ConfigError(
            f"keys file {path}", f"invalid YAML{' at ' + where if where else ''}"
        ) from None
    return KeyRing.parse(doc, str(path))


class KeyWatcher:
    """Holds the current KeyRing and reloads it when the file's content changes."""

    def __init__(self, path: Path, interval_s: float = 1.0) -> None:
        self.path = path
        self.interval_s = interval_s
        self.ring = load_keyring(path)  # fail at start: a gateway with a broken file won't run
        self._digest = self._read_digest()
        self.reloads = 0

    def _read_digest(self) -> bytes | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).digest()
        except OSError:
            return None

    def check(self) -> bool:
        """Reload if the content changed; keep the old ring if the new file is broken."""
        digest = self._read_digest()
        if digest is None or digest == self._digest:
            return False
        try:
            ring = load_keyring(self.path)
        except ConfigError as exc:
            log.error("keys file changed but is invalid; keeping the previous keys: %s", exc)
            self._digest = digest
            return False
        self.ring, self._digest = ring, digest
        self.reloads += 1
        log.info(
            "keys file reloaded: %d keys, %d tenants",
            len(ring.entries),
            len({t.name for _, t in ring.entries}),
        )
        return True

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[KeyWatcher]:
        async def check() -> None:
            self.check()

        async with every(self.interval_s, check, "keys-file-watcher"):
            yield self
