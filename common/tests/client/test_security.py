"""A client's TLS and token settings, read from the files the CLI flags name."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from tandem.client.security import ChannelSecurity


def test_security_files_are_read_as_regular_files_of_at_most_1_mib(tmp_path: Path) -> None:
    """As the token files are: read whole, a CA of /dev/zero grew the client without end."""
    pem = tmp_path / "ca.pem"
    pem.write_bytes(_ca_pem())
    assert ChannelSecurity.from_files(ca=pem).root_certificates == pem.read_bytes()
    with pytest.raises(ValueError, match=r"^cannot read a CA bundle: /dev/zero is not a regular file$"):
        ChannelSecurity.from_files(ca=Path("/dev/zero"))
    large = tmp_path / "chain.pem"
    large.write_bytes(b"x" * (1024 * 1024 + 1))
    with pytest.raises(
        ValueError,
        match=r"^cannot read a client certificate chain: .*chain.pem is over 1,048,576 bytes, the bound of a "
        r"client certificate chain \(1 MiB\)$",
    ):
        ChannelSecurity.from_files(cert=large, key=pem)
    with pytest.raises(ValueError, match=r"^cannot read a client private key: .*missing.pem: No such file"):
        ChannelSecurity.from_files(cert=pem, key=tmp_path / "missing.pem")


@pytest.mark.parametrize(
    "text", [b"decoder-host\n", b"-----BEGIN CERTIFICATE-----\n", b"\xff\xfe", b""], ids=repr
)
def test_a_ca_that_holds_no_pem_certificate_is_refused_naming_it(tmp_path: Path, text: bytes) -> None:
    """As the CLI's --tls-ca is (`flag_files.read_ca_bundle`): taken, such a CA failed every call as if
    nothing listened, gRPC saying why only in its log ("Could not load any root certificate")."""
    ca = tmp_path / "ca.pem"
    ca.write_bytes(text)
    with pytest.raises(ValueError, match=r"^cannot read a CA bundle: .*/ca.pem is not a PEM certificate$"):
        ChannelSecurity.from_files(ca=ca)


def _ca_pem() -> bytes:
    """A self-signed CA certificate, PEM."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return certificate.public_bytes(Encoding.PEM)
