"""The TLS a server listens with: its certificate, its key and, for mutual TLS, the CA its callers'
certificates are signed by, read and checked once when built (`TlsOptions`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tandem.client.errors import ConfigError
from tandem.client.flag_files import TlsFile, TlsFileError, TlsFiles, read_tls_files


@dataclass(frozen=True)
class TlsOptions:
    """PEM files of a TLS server, read once when built and handed to gRPC as read (rotated files need a
    restart). Read so, a file replaced between the check and the start cannot pass one and serve the
    other, and each is bounded (`tandem.client.flag_files`): a 1 GiB certificate file (a certificate,
    then zeros) passed the check, read through OpenSSL, and then grew the server by 1 GiB, read whole."""

    cert_file: Path  # the server's certificate chain, leaf first.
    key_file: Path  # its private key (unencrypted PEM).
    client_ca_file: Path | None = None  # set: mutual TLS, clients need a certificate this CA signed.
    # What the three files held when checked, for `server_credentials`: set by __post_init__ only.
    files: TlsFiles = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Each file is a regular file of at most 1 MiB holding PEM, and the key is the certificate's
        and unencrypted: else gRPC fails later with "Failed to bind"."""
        try:
            files = read_tls_files(self.cert_file, self.key_file, self.client_ca_file)
        except TlsFileError as error:
            raise ConfigError(_TLS_FIELDS[error.file], f": {error}") from None
        object.__setattr__(self, "files", files)  # frozen: the one write, as it is built

    @classmethod
    def from_paths(
        cls, cert: Path | None, key: Path | None, client_ca: Path | None = None
    ) -> TlsOptions | None:
        """From the `--tls-*` flags: None when none is given; a certificate needs its key."""
        if cert is None and key is None:
            if client_ca is not None:
                raise ConfigError("tls_client_ca", "needs --tls-cert and --tls-key (mTLS is TLS first)")
            return None
        if cert is None or key is None:
            raise ConfigError(
                "tls_cert" if cert is None else "tls_key", ": --tls-cert and --tls-key go together"
            )
        return cls(Path(cert), Path(key), None if client_ca is None else Path(client_ca))

    def server_credentials(self) -> grpc.ServerCredentials:
        """The credentials of the bytes checked when built; no file is read again."""
        root = self.files.ca_bundle
        return grpc.ssl_server_credentials(
            [(self.files.private_key, self.files.certificate_chain)],
            root_certificates=root,
            require_client_auth=root is not None,
        )


# The config field each of a server's TLS files fills, for a refusal.
_TLS_FIELDS = {
    TlsFile.CERTIFICATE_CHAIN: "tls_cert",
    TlsFile.PRIVATE_KEY: "tls_key",
    TlsFile.CA_BUNDLE: "tls_client_ca",
}
