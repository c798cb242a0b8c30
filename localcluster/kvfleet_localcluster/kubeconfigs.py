"""Kubeconfig documents for the local cluster's users: a bearer token or a client certificate."""

from __future__ import annotations

import base64
from pathlib import Path

import yaml

from kvfleet_localcluster.files import replace_file

CONTEXT = "kvfleet-local"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def document(
    url: str, namespace: str, ca_pem: bytes, user: dict[str, str], user_name: str = "kvfleet-admin"
) -> dict[str, object]:
    """`user` is a kubeconfig user stanza: {"token": ...} or the client-certificate pair."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": CONTEXT,
        "clusters": [
            {
                "name": CONTEXT,
                "cluster": {"server": url, "certificate-authority-data": _b64(ca_pem)},
            }
        ],
        "contexts": [
            {
                "name": CONTEXT,
                "context": {"cluster": CONTEXT, "user": user_name, "namespace": namespace},
            }
        ],
        "users": [{"name": user_name, "user": user}],
    }


def token_user(token: str) -> dict[str, str]:
    return {"token": token}


def certificate_user(cert_pem: bytes, key_pem: bytes) -> dict[str, str]:
    return {"client-certificate-data": _b64(cert_pem), "client-key-data": _b64(key_pem)}


def write(path: Path, doc: dict[str, object]) -> Path:
    """Readable by us only: it holds a credential."""
    replace_file(path, yaml.safe_dump(doc, sort_keys=False), mode=0o600)
    return path
