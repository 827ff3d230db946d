"""TlsOptions: a server's TLS files, checked when built."""

from __future__ import annotations

import pytest

from tandem.client.errors import ConfigError
from tandem.common.server_tls import TlsOptions


def test_a_tls_certificate_file_that_holds_no_certificate_is_named(tmp_path) -> None:
    """It said "key.pem is not the private key of cert.pem (None)"."""
    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("my-hostname\n")
    with pytest.raises(ConfigError, match=r"^tls_cert: .*cert.pem is not a PEM certificate$"):
        TlsOptions(not_pem, not_pem)
