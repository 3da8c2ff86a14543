"""A throwaway certificate authority for a secure deployment (the secure local stack, ``certs``),
made with ``cryptography``.

``make_pki(folder)`` writes, PEM only (Kafka reads PEM with ``ssl.keystore.type=PEM``, Quarkus
with ``quarkus.http.ssl.certificate.files``, Python's ``ssl`` natively):

- ``ca.pem``: the CA certificate, what clients trust (``DSH_SSL_CAFILE``);
- ``server.pem`` / ``server.key``: the server certificate chain (CA-signed, with subject
  alternative names for every advertised host, since aiokafka and httpx check hostnames) and
  its key, unencrypted PKCS#8 (``BEGIN PRIVATE KEY``).

Keys are EC P-256 (fast to make, accepted by Java 17 and OpenSSL). Private keys are written
with mode 0600. The CA key is never written: a run folder has no way to issue more
certificates, and a new run makes a new CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS: Final = ("127.0.0.1", "localhost")
VALID_DAYS: Final = 30


@dataclass(frozen=True, slots=True)
class Pki:
    """Where one run's certificate files are."""

    folder: Path

    @property
    def ca_file(self) -> Path:
        return self.folder / "ca.pem"

    @property
    def cert_file(self) -> Path:
        return self.folder / "server.pem"

    @property
    def key_file(self) -> Path:
        return self.folder / "server.key"


def make_pki(folder: Path, hosts: Sequence[str] = DEFAULT_HOSTS, *,
             common_name: str = "dsh-local-ca") -> Pki:
    """A new CA and one server certificate valid for ``hosts`` (names or IP addresses)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ca_cert = _builder(ca_name, ca_name, ca_key.public_key()).add_extension(
        x509.BasicConstraints(ca=True, path_length=0), critical=True).add_extension(
        x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                      content_commitment=False, key_encipherment=False,
                      data_encipherment=False, key_agreement=False, encipher_only=False,
                      decipher_only=False), critical=True).sign(ca_key, hashes.SHA256())
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    cert = _builder(subject, ca_name, key.public_key()).add_extension(
        x509.SubjectAlternativeName([_general_name(h) for h in hosts]), critical=False
    ).add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True
    ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                           ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
    ).sign(ca_key, hashes.SHA256())
    pki = Pki(folder)
    pem = serialization.Encoding.PEM
    pki.ca_file.write_bytes(ca_cert.public_bytes(pem))
    pki.cert_file.write_bytes(cert.public_bytes(pem) + ca_cert.public_bytes(pem))
    _write_private(pki.key_file, key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return pki


def _builder(subject: x509.Name, issuer: x509.Name,
             public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS)))


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write_private(path: Path, data: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
