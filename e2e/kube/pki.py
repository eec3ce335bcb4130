"""A throwaway PKI for one local control plane: a CA, the API server's serving certificate,
client certificates per component, and the service-account signing key pair.

Kubernetes authenticates X.509 clients by CN (user) and O (groups), so each component gets the
identity the default RBAC bootstrap policy expects (``system:kube-scheduler``, ``system:node:<n>``
in ``system:nodes``, ...). Keys are EC P-256: fast to generate on a small machine.
"""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID = datetime.timedelta(days=2)   # outlives any test session, useless afterwards


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    return x509.Name(parts + [x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


class CertificateAuthority:
    """Signs the certificates of one cluster; files live in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (x509.CertificateBuilder().subject_name(_name("pagedmodel-e2e-ca"))
                      .issuer_name(_name("pagedmodel-e2e-ca")).public_key(self._key.public_key())
                      .serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + _VALID)
                      .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                      .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                                     critical=True)
                      .sign(self._key, hashes.SHA256()))
        self.cert = self.directory / "ca.crt"
        self.key = self.directory / "ca.key"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        _write_key(self.key, self._key)

    def issue(self, name: str, common_name: str, organizations: tuple[str, ...] = (), *,
              server_hosts: tuple[str, ...] = (), client: bool = True) -> KeyPair:
        """A leaf certificate; ``server_hosts`` (DNS names or IPs) make it a serving certificate too."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        usages = ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else []) + \
                 ([ExtendedKeyUsageOID.SERVER_AUTH] if server_hosts else [])
        builder = (x509.CertificateBuilder().subject_name(_name(common_name, organizations))
                   .issuer_name(self._cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + _VALID)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.KeyUsage(True, False, True, False, False, False, False, False, False),
                                  critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if server_hosts:
            builder = builder.add_extension(x509.SubjectAlternativeName([_san(h) for h in server_hosts]),
                                            critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        pair = KeyPair(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(pair.key, key)
        return pair

    def service_account_keys(self) -> KeyPair:
        """The token signing key (RSA: what every JWT verifier accepts) and its public half."""
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pair = KeyPair(self.directory / "sa.pub", self.directory / "sa.key")
        pair.cert.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                            serialization.PublicFormat.SubjectPublicKeyInfo))
        _write_key(pair.key, key)
        return pair


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
