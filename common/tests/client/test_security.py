"""A client's TLS and token settings, read from the files the CLI flags name."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.client.security import ChannelSecurity


def test_security_files_are_read_as_regular_files_of_at_most_1_mib(tmp_path: Path) -> None:
    """As the token files are: read whole, a CA of /dev/zero grew the client without end."""
    pem = tmp_path / "ca.pem"
    pem.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    assert ChannelSecurity.from_files(ca=pem).root_certificates == b"-----BEGIN CERTIFICATE-----\n"
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
