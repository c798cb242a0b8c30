"""The CRDs as a real kube-apiserver sees them: created (so every CEL rule compiles and its
estimated cost fits the per-expression and per-CRD budgets, and every default passes its
field's rules), the hostile specs refused, and an InferenceService at the CRD's largest
sizes admitted within the runtime cost budget.

Runs where a kube-apiserver and etcd build is cached (~/.cache/kvfleet/controlplane/*/bin);
skipped elsewhere: the local cluster evaluates rules but does not estimate their cost."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_bench.spec_cost import CASES
from tests.integration.test_crd_validation import HOSTILE
from tests.support.objects import ROOT

BINARIES = sorted(Path.home().glob(".cache/kvfleet/controlplane/*/bin/kube-apiserver"))
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
ISVCS = "/apis/kvfleet.dev/v1alpha1/namespaces/default/inferenceservices"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certs(d: Path) -> None:
    """A CA, an admin client certificate (system:masters), the service-account key pair."""
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.crt", "-days", "1", "-subj", "/CN=test-ca", cwd=d)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "admin.key", "-out",
             "admin.csr", "-subj", "/CN=admin/O=system:masters", cwd=d)  # fmt: skip
    _openssl("x509", "-req", "-in", "admin.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "admin.crt", "-days", "1", cwd=d)  # fmt: skip


def _json(raw: bytes) -> Any:
    """A reply's JSON ({"message": text} for the plain text of /readyz and the like)."""
    try:
        return json.loads(raw or b"{}")
    except ValueError:
        return {"message": raw.decode(errors="replace")}


class Api:
    def __init__(self, url: str, d: Path) -> None:
        self.url = url
        self.tls = ssl.create_default_context()
        self.tls.check_hostname = False
        self.tls.verify_mode = ssl.CERT_NONE
        self.tls.load_cert_chain(d / "admin.crt", d / "admin.key")

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, context=self.tls, timeout=60) as r:
                return r.status, _json(r.read())
        except urllib.error.HTTPError as e:
            return e.code, _json(e.read())


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    if not BINARIES:
        pytest.skip("no kube-apiserver build cached under ~/.cache/kvfleet/controlplane")
    bin_dir, d = BINARIES[-1].parent, tmp_path_factory.mktemp("apiserver")
    _certs(d)
    client, peer, secure = _port(), _port(), _port()
    etcd = subprocess.Popen(
        [str(bin_dir / "etcd"), "--data-dir", str(d / "etcd"),
         "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    apiserver = subprocess.Popen(
        [str(bin_dir / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{client}",
         "--service-account-issuer=https://kubernetes.default.svc",
         f"--service-account-key-file={d / 'sa.pub'}",
         f"--service-account-signing-key-file={d / 'sa.key'}",
         f"--secure-port={secure}", "--bind-address=127.0.0.1", f"--cert-dir={d / 'certs'}",
         "--authorization-mode=AlwaysAllow", f"--client-ca-file={d / 'ca.crt'}",
         "--service-cluster-ip-range=10.96.0.0/16"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        server = Api(f"https://127.0.0.1:{secure}", d)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if server.call("GET", "/readyz")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("kube-apiserver did not become ready in 90 s")
        yield server
    finally:
        for p in (apiserver, etcd):
            p.terminate()
            p.wait(timeout=30)


def test_the_crds_are_created_and_enforced_by_a_real_api_server(api: Api) -> None:
    for name in ("kvfleet.dev_inferenceservices.yaml", "kvfleet.dev_inferencegateways.yaml"):
        status, body = api.call("POST", CRDS, yaml.safe_load((ROOT / "crds" / name).read_text()))
        assert status == 201, body.get("message")
    deadline = time.monotonic() + 30
    while api.call("GET", ISVCS)[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.2)  # the new resource is served once the CRD is established
    for obj, message in HOSTILE:
        status, body = api.call("POST", ISVCS, obj)
        assert status == 422 and message in body["message"], (obj["metadata"], body)
    for case, build in CASES.items():
        spec = build()
        spec["gateway"]["insecureNoAuth"] = True
        obj = {"apiVersion": "kvfleet.dev/v1alpha1", "kind": "InferenceService",
               "metadata": {"name": f"largest-{case}"}, "spec": spec}  # fmt: skip
        status, body = api.call("POST", ISVCS, obj)
        assert status == 201, (case, body.get("message"))
