"""Small files a flag names (a token file, a TLS setting's PEM files), read with a bound.

Such a file was read whole: `--auth-token-file /dev/zero` grew a decoder to 10.5 GB in 31 s before
anything said why, and a FIFO would block the start for ever. Only a regular file is read, and at most
its bound: one byte more is a refusal naming the file and the bound, so a mistaken path (a model file,
a device, a pipe) ends the start at once with a line, not with the memory of the host.

A TLS setting's PEM files (`read_tls_files`) are read so by the clients and the servers alike, each
once, and checked as read: what gRPC is handed is what was checked, even if a file is replaced after.
"""

from __future__ import annotations

import contextlib
import os
import re
import ssl
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

# A token is tens of bytes: 64 KiB holds about a thousand 64-character tokens with comments, far more
# than a rotation (old and new for a while) lists.
MAX_TOKEN_FILE_BYTES = 64 * 1024
# A PEM file of a TLS setting. The largest is a CA bundle: Mozilla's whole root store (certifi's
# cacert.pem) is about 290 KB, so 1 MiB holds it with room; a private CA, a chain or a key is a few KB.
MAX_PEM_FILE_BYTES = 1024 * 1024
# The lines a certificate is armoured between, as PEM writes it.
_BEGIN_CERTIFICATE, _END_CERTIFICATE = b"-----BEGIN CERTIFICATE-----", b"-----END CERTIFICATE-----"
# A private key's first line: PKCS#8 ("PRIVATE KEY", "ENCRYPTED PRIVATE KEY") or OpenSSL's older
# per-algorithm ones ("RSA PRIVATE KEY", "EC PRIVATE KEY"). Not ssh-keygen's "OPENSSH PRIVATE KEY",
# which neither OpenSSL nor gRPC reads: let through, it was blamed on the pair ("not the private key of").
_PEM_PRIVATE_KEY = re.compile(rb"-----BEGIN (?!OPENSSH )(?:[A-Z0-9]+ )*PRIVATE KEY-----")


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
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):  # before fdopen, which refuses a directory its own way
        os.close(fd)
        raise ValueError(f"{path} is not a regular file")
    if status.st_size > max_bytes:  # refused unread: a 100 MB image read 64 MiB to say so
        os.close(fd)
        raise ValueError(f"{path} is over {max_bytes:,} bytes, the bound of {what}")
    with os.fdopen(fd, "rb") as file:
        try:
            data = file.read(max_bytes + 1)  # one byte more tells an over-long file from one at the bound
        except OSError as error:
            raise ValueError(f"{path}: {error.strerror}") from None
    if len(data) > max_bytes:
        raise ValueError(f"{path} is over {max_bytes:,} bytes, the bound of {what}")
    return data


class TlsFile(Enum):
    """Which file of a TLS setting a refusal is about: its caller names the flag or the field."""

    CERTIFICATE_CHAIN = "a certificate chain"
    PRIVATE_KEY = "a private key"
    CA_BUNDLE = "a CA bundle"


class TlsFileError(ValueError):
    """A TLS setting's file that cannot be used; the message names its path and why."""

    def __init__(self, file: TlsFile, message: str) -> None:
        super().__init__(message)
        self.file = file


@dataclass(frozen=True)
class TlsFiles:
    """What a TLS setting's PEM files held when `read_tls_files` read and checked them."""

    certificate_chain: bytes | None = None  # this side's certificate, leaf first; None: none given.
    private_key: bytes | None = field(default=None, repr=False)  # the leaf's key, unencrypted.
    ca_bundle: bytes | None = None  # the CA(s) trusted for the other side's certificate.


def read_tls_files(
    certificate_chain: Path | None, private_key: Path | None, ca_bundle: Path | None
) -> TlsFiles:
    """The files given, each read once (a regular file of at most 1 MiB) and checked: a chain and a CA
    bundle hold PEM certificates, and a key given with its chain is the leaf's, unencrypted. Else gRPC
    says only "Could not load any root certificate" or "Failed to bind", in its log. A chain without its
    key (or a key without its chain) is its caller's to refuse, in the words of its flags. Raises
    TlsFileError."""
    chain = _read_pem(TlsFile.CERTIFICATE_CHAIN, certificate_chain)
    key = _read_pem(TlsFile.PRIVATE_KEY, private_key)
    ca = _read_pem(TlsFile.CA_BUNDLE, ca_bundle)
    if chain is not None and key is not None:
        _check_key(chain, key, f"{certificate_chain}", f"{private_key}")
    return TlsFiles(certificate_chain=chain, private_key=key, ca_bundle=ca)


def _read_pem(file: TlsFile, path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        data = read_bounded(Path(path), MAX_PEM_FILE_BYTES, f"{file.value} (1 MiB)")
    except ValueError as error:
        raise TlsFileError(file, str(error)) from None
    if file is TlsFile.PRIVATE_KEY:
        if not _PEM_PRIVATE_KEY.search(data):
            raise TlsFileError(file, f"{path} is not a PEM private key")
    elif not _holds_certificates(data):
        raise TlsFileError(file, f"{path} is not a PEM certificate")
    return data


def _holds_certificates(data: bytes) -> bool:
    # Only the certificates themselves need be ASCII, as OpenSSL and gRPC read a bundle: Fedora's and
    # RHEL's p11-kit bundles label certificates in UTF-8 ("# ... Főtanúsítvány") and an editor may write
    # a BOM, which they take; but a stray byte inside a certificate's base64 they refuse, so each block is
    # checked as it stands (dropping non-ASCII bytes from the whole file passed such a bundle).
    blocks = _certificate_blocks(data)
    if not blocks:
        return False
    try:
        cadata = "\n".join(block.decode("ascii") for block in blocks)
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=cadata)
    except (ssl.SSLError, UnicodeDecodeError):
        return False
    return True


def _certificate_blocks(data: bytes) -> list[bytes]:
    """Each certificate's block, its armour lines included, up to the first end line after its begin
    line. In one pass: a regular expression's lazy match tried every begin line against the rest of the
    file, and 450 KB of begin lines took 39 s to refuse."""
    blocks, start = [], 0
    while (begin := data.find(_BEGIN_CERTIFICATE, start)) != -1:
        end = data.find(_END_CERTIFICATE, begin)
        if end == -1:
            break  # no end line after this begin line, so none after a later one
        start = end + len(_END_CERTIFICATE)
        blocks.append(data[begin:start])
    return blocks


class _Encrypted(Exception):
    """OpenSSL asked for the key's password."""


def _refuse_password() -> bytes:
    # Without a password callback OpenSSL prompts on the terminal, and a start waits for an answer.
    raise _Encrypted


def _check_key(chain: bytes, key: bytes, chain_path: str, key_path: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        with _unnamed_files(chain, key) as (chain_file, key_file):
            context.load_cert_chain(chain_file, key_file, password=_refuse_password)
    except _NowhereToCheck as error:
        raise TlsFileError(
            TlsFile.PRIVATE_KEY,
            f"{key_path} cannot be checked against {chain_path}: OpenSSL reads a key from a file only, "
            f"memfd (with /proc/self/fd) is not available here and no temporary folder could be made "
            f"({error}): set TMPDIR to a writable folder",
        ) from None
    except _Encrypted:
        raise TlsFileError(
            TlsFile.PRIVATE_KEY,
            f"{key_path} is encrypted: gRPC takes no password (`openssl pkey -in {key_path}` "
            "writes it decrypted)",
        ) from None
    except ssl.SSLError as error:
        # The certificate is loaded first, so a key whose type has no certificate beside it (RSA for
        # an EC one) is of another type: OpenSSL's reason read as if no certificate were given.
        reason = "a key of another type" if error.reason == "NO_CERTIFICATE_ASSIGNED" else error.reason
        why = f" ({reason})" if reason else ""
        raise TlsFileError(
            TlsFile.PRIVATE_KEY, f"{key_path} is not the private key of {chain_path}{why}"
        ) from None


class _NowhereToCheck(Exception):
    """Neither memory nor a temporary folder could hold the files for OpenSSL; says why the folder not."""


@contextlib.contextmanager
def _unnamed_files(*contents: bytes) -> Iterator[list[str]]:
    """Paths that read as `contents`, for OpenSSL's key check, which takes paths only (ssl has no
    load_cert_chain from bytes, and `cryptography`, which has, is not installed with the gateway): the
    bytes checked are the bytes read, where reading the files again could find them replaced. In memory
    where the system has memfd (Linux) and /proc shows it; elsewhere in a private temporary folder (0700),
    removed once checked. Raises _NowhereToCheck where neither can be had (a seccomp filter refusing
    memfd_create, or no /proc, with a read-only /tmp): that was a PermissionError or FileNotFoundError
    traceback out of read_tls_files, which none of its callers catch."""
    with contextlib.ExitStack() as stack:
        paths = _in_memory(stack, contents) if hasattr(os, "memfd_create") else None
        if paths is None:
            try:
                folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tandem-pem-")))
                paths = []
                for number, data in enumerate(contents):
                    (folder / f"{number}.pem").write_bytes(data)
                    paths.append(str(folder / f"{number}.pem"))
            except OSError as error:
                raise _NowhereToCheck(_os_error_words(error)) from None
        yield paths


def _in_memory(stack: contextlib.ExitStack, contents: tuple[bytes, ...]) -> list[str] | None:
    """A memfd's path for each of `contents`, closed with `stack`; None where memfd_create is refused
    (a seccomp filter's EPERM) or /proc is not mounted (a chroot, a bare container): OpenSSL opens the
    path, and /proc/self/fd/N named no file."""
    with contextlib.ExitStack() as memories:
        paths = []
        for data in contents:
            try:
                memory = memories.enter_context(
                    os.fdopen(os.memfd_create("tandem-pem", os.MFD_CLOEXEC), "wb")
                )
            except OSError:
                return None
            memory.write(data)
            memory.flush()
            path = f"/proc/self/fd/{memory.fileno()}"  # a fresh open, at offset 0
            if not os.path.exists(path):
                return None
            paths.append(path)
        stack.enter_context(memories.pop_all())  # held until the check is done
        return paths


def _os_error_words(error: OSError) -> str:
    # "[Errno 30] Read-only file system: '/tmp/tandem-pem-x'" without its number; gettempdir's own
    # "No usable temporary directory found in [...]" has none to drop.
    if error.strerror is None:
        return str(error)
    return f"{error.filename}: {error.strerror}" if error.filename else error.strerror
