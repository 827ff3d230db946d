"""A client's TLS and bearer-token settings (`ChannelSecurity`), and their reading from the files the
CLI flags name. `open_channel` (`tandem.client.channel`) applies them; the token goes with every call
(`tandem.client.auth`, `tandem.client.call_details`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .auth import read_token
from .flag_files import TlsFile, TlsFileError, TlsFiles, read_tls_files


@dataclass(frozen=True)
class ChannelSecurity:
    """How a client reaches a server that uses TLS and/or bearer tokens. The default is plaintext."""

    is_tls: bool = False  # TLS even without the PEM fields (then the system's trusted roots).
    root_certificates: bytes | None = None  # PEM CA(s) trusted for the server certificate.
    certificate_chain: bytes | None = None  # mutual TLS: this client's certificate, PEM.
    private_key: bytes | None = field(default=None, repr=False)  # mutual TLS: its key, PEM.
    token: str | None = field(default=None, repr=False)  # sent as `authorization: Bearer <token>`.

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs its private key, and the other way round")

    @property
    def uses_tls(self) -> bool:
        return self.is_tls or any(
            v is not None for v in (self.root_certificates, self.certificate_chain, self.private_key)
        )

    @classmethod
    def from_files(
        cls,
        ca: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        token_file: Path | None = None,
        is_tls: bool = False,
    ) -> ChannelSecurity:
        """From PEM files and a token file (its first token), as the CLI flags name them, read and
        checked as the CLI's and the servers' are (`flag_files.read_tls_files`): each a regular file of
        at most 1 MiB (read whole, /dev/zero grew the process without end), the CA and the certificate
        PEM certificates (a CA that holds none made every call fail as if nothing listened), the key
        the certificate's. Raises ValueError naming the file and what it is."""
        try:
            files = read_tls_files(cert, key, ca)
        except TlsFileError as error:
            raise ValueError(f"cannot use {_CLIENT_FILES[error.file]}: {error}") from None
        return cls.of(files, None if token_file is None else read_token(token_file), is_tls)

    @classmethod
    def of(cls, files: TlsFiles, token: str | None, is_tls: bool) -> ChannelSecurity:
        """From files `read_tls_files` read and checked (here, and by the CLI's flags, which name their
        own refusals), and a token."""
        return cls(
            is_tls=is_tls,
            root_certificates=files.ca_bundle,
            certificate_chain=files.certificate_chain,
            private_key=files.private_key,
            token=token,
        )


# What each file is to a client, for a refusal.
_CLIENT_FILES = {
    TlsFile.CERTIFICATE_CHAIN: "a client certificate chain",
    TlsFile.PRIVATE_KEY: "a client private key",
    TlsFile.CA_BUNDLE: "a CA bundle",
}

PLAINTEXT = ChannelSecurity()
