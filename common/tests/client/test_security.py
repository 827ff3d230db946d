"""A client's TLS and token settings, read from the files the CLI flags name."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.tests.client.pem_files import self_signed
from tandem.client.security import ChannelSecurity


def test_security_files_are_read_as_regular_files_of_at_most_1_mib(tmp_path: Path) -> None:
    """As the token files are: read whole, a CA of /dev/zero grew the client without end."""
    pem, _ = self_signed(tmp_path, "ca")
    assert ChannelSecurity.from_files(ca=pem).root_certificates == pem.read_bytes()
    with pytest.raises(ValueError, match=r"^cannot use a CA bundle: /dev/zero is not a regular file$"):
        ChannelSecurity.from_files(ca=Path("/dev/zero"))
    large = tmp_path / "chain.pem"
    large.write_bytes(b"x" * (1024 * 1024 + 1))
    with pytest.raises(
        ValueError,
        match=r"^cannot use a client certificate chain: .*chain.pem is over 1,048,576 bytes, the bound of a "
        r"certificate chain \(1 MiB\)$",
    ):
        ChannelSecurity.from_files(cert=large, key=pem)
    with pytest.raises(ValueError, match=r"^cannot use a client private key: .*missing.pem: No such file"):
        ChannelSecurity.from_files(cert=pem, key=tmp_path / "missing.pem")


@pytest.mark.parametrize(
    "text", [b"decoder-host\n", b"-----BEGIN CERTIFICATE-----\n", b"\xff\xfe", b""], ids=repr
)
def test_a_ca_that_holds_no_pem_certificate_is_refused_naming_it(tmp_path: Path, text: bytes) -> None:
    """As the CLI's --tls-ca is (`flag_files.read_tls_files`): taken, such a CA failed every call as if
    nothing listened, gRPC saying why only in its log ("Could not load any root certificate")."""
    ca = tmp_path / "ca.pem"
    ca.write_bytes(text)
    with pytest.raises(ValueError, match=r"^cannot use a CA bundle: .*/ca.pem is not a PEM certificate$"):
        ChannelSecurity.from_files(ca=ca)


def test_a_client_key_that_is_not_its_certificates_is_refused_before_any_call(tmp_path: Path) -> None:
    """As the servers' --tls-key is: taken, every call failed UNAVAILABLE ("Failed to create security
    handshaker"), gRPC's log alone saying "Invalid private key"."""
    cert, key = self_signed(tmp_path, "client")
    _, other = self_signed(tmp_path, "other")
    assert ChannelSecurity.from_files(cert=cert, key=key).private_key == key.read_bytes()
    with pytest.raises(
        ValueError,
        match=r"^cannot use a client private key: .*/other-key.pem is not the private key of .*/client.pem "
        r"\(KEY_VALUES_MISMATCH\)$",
    ):
        ChannelSecurity.from_files(cert=cert, key=other)
