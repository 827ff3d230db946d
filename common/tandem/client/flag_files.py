"""Small files a flag names (a token file, a CA bundle), read with a bound.

Such a file was read whole: `--auth-token-file /dev/zero` grew a decoder to 10.5 GB in 31 s before
anything said why, and a FIFO would block the start for ever. Only a regular file is read, and at most
its bound: one byte more is a refusal naming the file and the bound, so a mistaken path (a model file,
a device, a pipe) ends the start at once with a line, not with the memory of the host.
"""

from __future__ import annotations

import os
import re
import ssl
import stat
from pathlib import Path

# A token is tens of bytes: 64 KiB holds about a thousand 64-character tokens with comments, far more
# than a rotation (old and new for a while) lists.
MAX_TOKEN_FILE_BYTES = 64 * 1024
# A CA bundle: Mozilla's whole root store (certifi's cacert.pem) is about 290 KB, so 1 MiB holds it
# with room; a private CA is a few KB.
MAX_CA_BUNDLE_BYTES = 1024 * 1024
# A certificate as PEM armours it, the bytes between the lines included.
_PEM_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", re.S)


def read_bounded(path: Path, max_bytes: int, what: str) -> bytes:
    """The bytes of `path`, a regular file of at most `max_bytes` (`what` it is, for the refusal).
    Raises ValueError saying which rule the file breaks (empty path, not a regular file, over the
    bound, unreadable), naming the path."""
    if str(path) in ("", "."):
        # click turns an empty value into Path("."), which `open` reported as "Is a directory: '.'".
        raise ValueError("the path is empty (or '.'): name a file")
    try:
        # O_NONBLOCK: opening a FIFO would otherwise wait for a writer before fstat could refuse it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a directory its own way
        os.close(fd)
        raise ValueError(f"{path} is not a regular file")
    with os.fdopen(fd, "rb") as file:
        try:
            data = file.read(max_bytes + 1)  # one byte more tells an over-long file from one at the bound
        except OSError as error:
            raise ValueError(f"{path}: {error.strerror}") from None
    if len(data) > max_bytes:
        raise ValueError(f"{path} is over {max_bytes:,} bytes, the bound of {what}")
    return data


def read_ca_bundle(path: Path) -> bytes:
    """A client's CA bundle (PEM), checked as the services check theirs: else gRPC says only "Could not
    load any root certificate" in its log and every call fails as if nothing listened. Raises ValueError."""
    data = read_bounded(path, MAX_CA_BUNDLE_BYTES, "a CA bundle (1 MiB)")
    # Only the certificates themselves need be ASCII, as OpenSSL and gRPC read a bundle: Fedora's and
    # RHEL's p11-kit bundles label certificates in UTF-8 ("# ... Főtanúsítvány") and an editor may write
    # a BOM, which they take; but a stray byte inside a certificate's base64 they refuse, so each block is
    # checked as it stands (dropping non-ASCII bytes from the whole file passed such a bundle).
    blocks = _PEM_CERTIFICATE.findall(data)
    try:
        if not blocks:
            raise ValueError("no certificate")
        cadata = "\n".join(block.decode("ascii") for block in blocks)
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=cadata)
    except (ssl.SSLError, ValueError):  # ValueError: UnicodeDecodeError (not ASCII), or no certificate
        raise ValueError(f"{path} is not a PEM certificate") from None
    return data
