"""How the operator logs in to the API server: in a pod, or from a kubeconfig.

One source of credentials for both of the operator's clients: the `kubernetes` client that
reads and writes children, and kopf's watches. Both are built from the same
`kubernetes.client.Configuration`, which the `kubernetes` package loads the way kubectl
does: in-cluster (the service account's projected token, which it re-reads as the kubelet
rotates it, the cluster CA and `KUBERNETES_SERVICE_HOST/PORT`), or a kubeconfig (tokens,
client certificates, exec plugins, the current context or `--context`). kopf asks for a
fresh `ConnectionInfo` whenever the server answers 401, so rotated and exec-issued tokens
are picked up without a restart.

Order, as kubectl's: an explicit `--kubeconfig`/`--context` wins; then in-cluster; then
`$KUBECONFIG` or `~/.kube/config`. There is no credential-less test path: the local
cluster authenticates every client, as a real one does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf
import kubernetes.client
import kubernetes.config
from kubernetes.config.incluster_config import (
    SERVICE_CERT_FILENAME,
    SERVICE_HOST_ENV_NAME,
    SERVICE_TOKEN_FILENAME,
    InClusterConfigLoader,
)


class LoginFailed(RuntimeError):
    """No usable credentials; the message says what was tried."""


@dataclass(frozen=True)
class Credentials:
    kubeconfig: str | None = None
    """A kubeconfig file; None: in-cluster when in a pod, else $KUBECONFIG or ~/.kube/config."""
    context: str | None = None
    """A kubeconfig context; None: the file's current-context."""
    token_file: Path = Path(SERVICE_TOKEN_FILENAME)
    """The service-account token a pod gets (a seam for tests of the in-cluster path)."""
    ca_file: Path = Path(SERVICE_CERT_FILENAME)
    """The cluster CA a pod gets."""

    def in_cluster(self, environ: os._Environ[str] | dict[str, str]) -> bool:
        return (
            self.kubeconfig is None
            and self.context is None
            and SERVICE_HOST_ENV_NAME in environ
            and self.token_file.exists()
        )


def client_configuration(
    creds: Credentials, environ: os._Environ[str] | dict[str, str] | None = None
) -> kubernetes.client.Configuration:
    """A `kubernetes` client configuration with the operator's credentials loaded."""
    environ = os.environ if environ is None else environ
    cfg = kubernetes.client.Configuration()
    if creds.in_cluster(environ):
        InClusterConfigLoader(
            token_filename=str(creds.token_file),
            cert_filename=str(creds.ca_file),
            try_refresh_token=True,  # the kubelet rotates projected tokens
            environ=environ,
        ).load_and_set(cfg)  # type: ignore[no-untyped-call]
        return cfg
    try:
        kubernetes.config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=creds.kubeconfig or environ.get("KUBECONFIG") or None,
            context=creds.context,
            client_configuration=cfg,
            persist_config=False,
        )
    except (kubernetes.config.ConfigException, OSError) as exc:
        where = creds.kubeconfig or environ.get("KUBECONFIG") or "~/.kube/config"
        raise LoginFailed(
            f"cannot log in: not in a pod ({SERVICE_HOST_ENV_NAME} unset or no token at "
            f"{creds.token_file}) and no usable kubeconfig at {where}: {exc}"
        ) from exc
    return cfg


def api_client(creds: Credentials) -> kubernetes.client.ApiClient:
    return kubernetes.client.ApiClient(client_configuration(creds))


def connection_info(cfg: kubernetes.client.Configuration) -> kopf.ConnectionInfo:
    """kopf's view of the same credentials (its watches use aiohttp, not the client)."""
    # get_api_key_with_prefix runs the refresh hook (rotated or exec-issued tokens).
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix(
        "authorization"
    )
    scheme, _, token = (header or "").strip().partition(" ")
    if not token:  # a bare token without a scheme
        scheme, token = "Bearer", scheme
    token = token.strip()  # a token file's trailing newline
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert or None,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme if token else None,
        token=token or None,
        certificate_path=cfg.cert_file or None,
        private_key_path=cfg.key_file or None,
    )


def kopf_login(creds: Credentials) -> Any:
    """A `@kopf.on.login` handler: credentials loaded again on every (re-)login."""

    def login(**_: Any) -> kopf.ConnectionInfo:
        try:
            return connection_info(client_configuration(creds))
        except LoginFailed as exc:
            raise kopf.LoginError(str(exc)) from exc

    return login
