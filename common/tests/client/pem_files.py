"""PEM files for the tests of TLS: what a client or a server reads, and the pairs they serve with."""

from __future__ import annotations

import datetime
import errno
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    KeySerializationEncryption,
    NoEncryption,
    PrivateFormat,
)
from cryptography.x509.oid import NameOID


def self_signed(
    directory: Path, name: str, encryption: KeySerializationEncryption | None = None
) -> tuple[Path, Path]:
    """A self-signed CA certificate `<name>.pem` and its key `<name>-key.pem` (unencrypted unless
    `encryption` says how)."""
    key = ec.generate_private_key(ec.SECP256R1())
    return _write(directory, name, _certificate(name, key, _name(name), key, is_ca=True), key, encryption)


def localhost_pki(directory: Path) -> tuple[bytes, Path, Path]:
    """A CA (PEM) and a server certificate `server.pem` and key `server-key.pem` it signed for the name
    `localhost` alone: a connection that goes by an IP address fails its check."""
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("test CA", ca_key, _name("test CA"), ca_key, is_ca=True)
    server = _certificate("localhost", server_key, _name("test CA"), ca_key, is_ca=False)
    return (ca.public_bytes(Encoding.PEM), *_write(directory, "server", server, server_key))


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    signer: ec.EllipticCurvePrivateKey,
    is_ca: bool,
) -> x509.Certificate:
    """`key`'s certificate naming `name`, valid for a day, `signer` its issuer's key; a leaf's is for
    the DNS name `name`."""
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if not is_ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _write(
    directory: Path,
    name: str,
    certificate: x509.Certificate,
    key: ec.EllipticCurvePrivateKey,
    encryption: KeySerializationEncryption | None = None,
) -> tuple[Path, Path]:
    cert_file, key_file = directory / f"{name}.pem", directory / f"{name}-key.pem"
    cert_file.write_bytes(certificate.public_bytes(Encoding.PEM))
    key_file.write_bytes(key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, encryption or NoEncryption()))
    return cert_file, key_file


def memfd_refused(name: str, flags: int = 0) -> int:
    """os.memfd_create as a seccomp filter answers it (EPERM), for the key check's fallbacks."""
    raise PermissionError(errno.EPERM, "Operation not permitted")
