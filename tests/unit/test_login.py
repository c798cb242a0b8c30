"""The operator's login: in a pod (service-account token, CA, KUBERNETES_SERVICE_*) and from a
kubeconfig (token, client certificate, exec plugin, current context or --context), the same
credentials for the `kubernetes` client and for kopf's watches."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator.login import (
    Credentials,
    LoginFailed,
    client_configuration,
    connection_info,
    kopf_login,
)

POD_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def pod_files(tmp: Path, token: str = "sa-token-1") -> Credentials:
    (tmp / "token").write_text(token + "\n")
    (tmp / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    return Credentials(token_file=tmp / "token", ca_file=tmp / "ca.crt")


def kubeconfig(tmp: Path, users: dict[str, Any], current: str = "a") -> str:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": current,
        "clusters": [
            {"name": "one", "cluster": {"server": "https://one.example:6443"}},
            {"name": "two", "cluster": {"server": "https://two.example:6443"}},
        ],
        "contexts": [
            {"name": "a", "context": {"cluster": "one", "user": "ua"}},
            {"name": "b", "context": {"cluster": "two", "user": "ub"}},
        ],
        "users": [{"name": n, "user": u} for n, u in users.items()],
    }
    path = tmp / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_in_cluster_service_account(tmp_path: Path) -> None:
    creds = pod_files(tmp_path)
    cfg = client_configuration(creds, environ=dict(POD_ENV))
    info = connection_info(cfg)
    assert info.server == "https://10.96.0.1:443"
    assert info.ca_path == str(tmp_path / "ca.crt")
    assert (info.scheme or "").lower() == "bearer"
    assert info.token == "sa-token-1"
    assert not info.insecure


def test_in_cluster_token_rotation_is_picked_up_at_relogin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    creds = pod_files(tmp_path)
    for k, v in POD_ENV.items():
        monkeypatch.setenv(k, v)
    login = kopf_login(creds)
    assert login().token == "sa-token-1"
    (tmp_path / "token").write_text("sa-token-2")  # the kubelet rotated it
    assert login().token == "sa-token-2"


def test_not_in_a_pod_without_the_service_env(tmp_path: Path) -> None:
    creds = pod_files(tmp_path)
    assert not creds.in_cluster({})
    with pytest.raises(LoginFailed, match="not in a pod"):
        client_configuration(creds, environ={"KUBECONFIG": str(tmp_path / "missing")})


def test_kubeconfig_token_and_context(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path, {"ua": {"token": "tok-a"}, "ub": {"token": "tok-b"}})
    info = connection_info(client_configuration(Credentials(kubeconfig=path), environ={}))
    assert (info.server, info.token) == ("https://one.example:6443", "tok-a")
    info = connection_info(
        client_configuration(Credentials(kubeconfig=path, context="b"), environ={})
    )
    assert (info.server, info.token) == ("https://two.example:6443", "tok-b")


def test_kubeconfig_from_the_environment(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path, {"ua": {"token": "tok-a"}})
    info = connection_info(client_configuration(Credentials(), environ={"KUBECONFIG": path}))
    assert info.token == "tok-a"


def test_explicit_kubeconfig_wins_over_in_cluster(tmp_path: Path) -> None:
    pod = pod_files(tmp_path)
    path = kubeconfig(tmp_path, {"ua": {"token": "tok-a"}})
    creds = Credentials(kubeconfig=path, token_file=pod.token_file, ca_file=pod.ca_file)
    assert connection_info(client_configuration(creds, environ=dict(POD_ENV))).token == "tok-a"


def test_kubeconfig_client_certificate(tmp_path: Path) -> None:
    cert, key = b"-----BEGIN CERTIFICATE-----\nX\n", b"-----BEGIN PRIVATE KEY-----\nY\n"
    user = {
        "client-certificate-data": base64.b64encode(cert).decode(),
        "client-key-data": base64.b64encode(key).decode(),
    }
    path = kubeconfig(tmp_path, {"ua": user})
    info = connection_info(client_configuration(Credentials(kubeconfig=path), environ={}))
    assert info.token is None
    assert Path(str(info.certificate_path)).read_bytes() == cert
    assert Path(str(info.private_key_path)).read_bytes() == key


def test_kubeconfig_exec_plugin(tmp_path: Path) -> None:
    plugin = tmp_path / "plugin.py"
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "kind": "ExecCredential",
        "status": {"token": "from-exec"},
    }
    plugin.write_text(f"print({json.dumps(json.dumps(credential))})\n")
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": sys.executable,
            "args": [str(plugin)],
            "interactiveMode": "Never",
        }
    }
    path = kubeconfig(tmp_path, {"ua": user})
    info = connection_info(client_configuration(Credentials(kubeconfig=path), environ={}))
    assert info.token == "from-exec"
