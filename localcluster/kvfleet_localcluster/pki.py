"""The local cluster's certificates: the cluster CA (`CertificateAuthority`), which signs the
API server's serving certificate, the client certificates the real API server authenticates
(the admin, each node agent as `system:node:<name>`) and the node agents' kubelet-API serving
certificate (`ClusterPKI`); and the key pair ServiceAccount tokens are signed with.

Every client — kubectl from a kubeconfig, a pod from its mounted `ca.crt` — checks the server
against the cluster CA, so in-cluster clients (the `kubernetes` package's in-cluster loader
always uses `https://`) log in exactly as on a real cluster.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=365)


@dataclass(frozen=True)
class ClusterPKI:
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    def write(self, directory: Path) -> tuple[Path, Path, Path]:
        """ca.crt, apiserver.crt, apiserver.key in `directory` (the key readable by us only)."""
        directory.mkdir(parents=True, exist_ok=True)
        ca, cert, key = (
            directory / "ca.crt",
            directory / "apiserver.crt",
            directory / "apiserver.key",
        )
        ca.write_bytes(self.ca_pem)
        cert.write_bytes(self.cert_pem)
        key.touch(mode=0o600)
        key.write_bytes(self.key_pem)
        return ca, cert, key

    def server_context(self, directory: Path) -> ssl.SSLContext:
        _, cert, key = self.write(directory)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        return ctx


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    alt_names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(alt_names)


@dataclass(frozen=True)
class CertificateAuthority:
    """The cluster CA with its key: it signs serving certificates and the client certificates
    a real API server authenticates (`--client-ca-file`: CN is the user, O the groups)."""

    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def create(cls) -> CertificateAuthority:
        now = datetime.datetime.now(datetime.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        usage = x509.KeyUsage(
            digital_signature=True,
            key_cert_sign=True,
            crl_sign=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            encipher_only=False,
            decipher_only=False,
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name("kvfleet-local-ca"))
            .issuer_name(_name("kvfleet-local-ca"))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(usage, critical=True)
            .sign(key, hashes.SHA256())
        )
        return cls(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))

    def sign(
        self,
        common_name: str,
        hosts: list[str] | None = None,
        organizations: tuple[str, ...] = (),
        client: bool = False,
    ) -> tuple[bytes, bytes]:
        """(certificate, key) PEM: a serving certificate for `hosts`, or with `client` a
        client certificate for user `common_name` in groups `organizations`."""
        ca_cert = x509.load_pem_x509_certificate(self.cert_pem)
        ca_key = serialization.load_pem_private_key(self.key_pem, None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        now = datetime.datetime.now(datetime.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        subject.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(subject))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        if hosts:
            builder = builder.add_extension(_san(hosts), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def service_account_key_pair() -> tuple[bytes, bytes]:
    """(private, public) PEM: the API server signs ServiceAccount tokens with the private key
    and verifies them with the public one (ES256)."""
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return _pem_key(key), public
