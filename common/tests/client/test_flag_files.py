"""Files a flag names are read only as a regular file within a bound, and a TLS setting's PEM files only
as PEM, a key only with the certificate it belongs to; each refusal names the path and what is wrong
with it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from cryptography.hazmat.primitives.serialization import (
    BestAvailableEncryption,
    Encoding,
    NoEncryption,
    PrivateFormat,
)

from common.tests.client.pem_files import memfd_refused, self_signed
from tandem.client.flag_files import (
    MAX_PEM_FILE_BYTES,
    TlsFile,
    TlsFileError,
    read_bounded,
    read_tls_files,
)


def read_ca_bundle(path: Path) -> bytes | None:
    return read_tls_files(None, None, path).ca_bundle


def test_a_file_within_its_bound_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    assert read_bounded(path, 10, "a test file") == b"x" * 10


def test_one_byte_past_the_bound_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 11)
    with pytest.raises(ValueError, match=r"/f is over 10 bytes, the bound of a test file$"):
        read_bounded(path, 10, "a test file")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_a_device_is_not_read(device: str) -> None:
    with pytest.raises(ValueError, match=f"^{device} is not a regular file$"):
        read_bounded(Path(device), 10, "a test file")


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match="fifo is not a regular file$"):
        read_bounded(tmp_path / "fifo", 10, "a test file")


def test_a_directory_or_a_missing_file_is_said_as_the_system_says_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"/absent: No such file or directory$"):
        read_bounded(tmp_path / "absent", 10, "a test file")
    with pytest.raises(ValueError, match=r"is not a regular file$"):
        read_bounded(tmp_path, 10, "a test file")


def test_an_empty_path_is_named_empty_not_dot() -> None:
    # click turns `--flag ''` into Path("."), which was said as ".: Is a directory".
    with pytest.raises(ValueError, match=r"^the path is empty \(or '.'\): name a file$"):
        read_bounded(Path(""), 10, "a test file")


def test_the_whole_mozilla_root_store_is_a_ca_bundle_within_its_bound() -> None:
    certifi = pytest.importorskip("certifi")
    bundle = Path(certifi.where())
    assert bundle.stat().st_size < MAX_PEM_FILE_BYTES
    assert read_ca_bundle(bundle) == bundle.read_bytes()


@pytest.mark.parametrize("before", ["\ufeff", "# NetLock Arany (Class Gold) Főtanúsítvány\n"])
def test_a_ca_bundle_with_utf8_labels_or_a_bom_is_read_as_openssl_reads_it(
    tmp_path: Path, before: str
) -> None:
    """Fedora's and RHEL's bundles label certificates in UTF-8; they were refused as "not a PEM
    certificate" while the services and gRPC took them."""
    certifi = pytest.importorskip("certifi")
    text = Path(certifi.where()).read_text()
    first = text[text.index("-----BEGIN CERTIFICATE-----") : text.index("-----END CERTIFICATE-----") + 25]
    path = tmp_path / "ca.pem"
    path.write_bytes(f"{before}{first}\n".encode())
    assert read_ca_bundle(path) == path.read_bytes()


def test_a_ca_bundle_with_a_non_ascii_byte_inside_a_certificate_is_refused(tmp_path: Path) -> None:
    """OpenSSL and gRPC refuse it ("Could not load any root certificate"); read with its non-ASCII bytes
    dropped, it passed the check and every call then failed as if nothing listened."""
    certifi = pytest.importorskip("certifi")
    text = Path(certifi.where()).read_text()
    first = text[text.index("-----BEGIN CERTIFICATE-----") : text.index("-----END CERTIFICATE-----") + 25]
    lines = first.splitlines()
    lines[3] = lines[3][:10] + "é" + lines[3][10:]
    path = tmp_path / "ca.pem"
    path.write_bytes("\n".join(lines).encode())
    with pytest.raises(ValueError, match=r"/ca.pem is not a PEM certificate$"):
        read_ca_bundle(path)


@pytest.mark.parametrize("text", [b"garbage\n", b"-----BEGIN CERTIFICATE-----\n", b"\xff\xfe", b""])
def test_a_ca_bundle_that_holds_no_pem_certificate_is_refused_naming_it(tmp_path: Path, text: bytes) -> None:
    # gRPC logged "Could not load any root certificate" and each call then failed as if nothing listened.
    path = tmp_path / "ca.pem"
    path.write_bytes(text)
    with pytest.raises(ValueError, match=r"/ca.pem is not a PEM certificate$"):
        read_ca_bundle(path)


def test_a_ca_bundle_past_1_mib_is_refused_naming_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "ca.pem"
    path.write_bytes(b"#" * (MAX_PEM_FILE_BYTES + 1))
    with pytest.raises(ValueError, match=r"is over 1,048,576 bytes, the bound of a CA bundle \(1 MiB\)$"):
        read_ca_bundle(path)


@pytest.mark.timeout(10)
def test_a_file_of_begin_lines_and_no_end_line_is_refused_at_once(tmp_path: Path) -> None:
    """Each begin line was tried against the rest of the file: 450 KB of them took 39 s to refuse, so a
    bundle at the bound held a start for minutes."""
    path = tmp_path / "ca.pem"
    line = b"-----BEGIN CERTIFICATE-----\n"
    path.write_bytes(line * (MAX_PEM_FILE_BYTES // len(line)))
    with pytest.raises(TlsFileError, match=r"/ca.pem is not a PEM certificate$") as refused:
        read_ca_bundle(path)
    assert refused.value.file is TlsFile.CA_BUNDLE


def test_a_certificate_chain_and_its_key_are_read_as_they_are(tmp_path: Path) -> None:
    chain, key = self_signed(tmp_path, "server")
    files = read_tls_files(chain, key, None)
    assert (files.certificate_chain, files.private_key, files.ca_bundle) == (
        chain.read_bytes(),
        key.read_bytes(),
        None,
    )
    assert "PRIVATE KEY" not in repr(files)


def test_a_certificate_chain_that_holds_no_certificate_is_refused_as_a_ca_bundle_is(tmp_path: Path) -> None:
    _, key = self_signed(tmp_path, "server")
    chain = tmp_path / "chain.pem"
    chain.write_text("my-hostname\n")
    with pytest.raises(TlsFileError, match=r"/chain.pem is not a PEM certificate$") as refused:
        read_tls_files(chain, key, None)
    assert refused.value.file is TlsFile.CERTIFICATE_CHAIN


def test_a_key_file_that_holds_no_private_key_is_refused_naming_it(tmp_path: Path) -> None:
    """A certificate given as the key (the two paths swapped) was said as "key values mismatch" or
    OpenSSL's "PEM lib", or by gRPC as "Failed to bind"."""
    chain, _ = self_signed(tmp_path, "server")
    with pytest.raises(TlsFileError, match=r"/server.pem is not a PEM private key$") as refused:
        read_tls_files(chain, chain, None)
    assert refused.value.file is TlsFile.PRIVATE_KEY


def test_an_openssh_key_is_not_a_pem_private_key(tmp_path: Path) -> None:
    """ssh-keygen's own format (~/.ssh/id_ed25519) has PEM's armour, but neither OpenSSL nor gRPC reads
    it: it was refused as "not the private key of" the certificate, with no reason, as if the pair were
    wrong."""
    chain, _ = self_signed(tmp_path, "server")
    key = tmp_path / "id_ed25519"
    openssh = ed25519.Ed25519PrivateKey.generate().private_bytes(
        Encoding.PEM, PrivateFormat.OpenSSH, NoEncryption()
    )
    key.write_bytes(openssh)
    with pytest.raises(TlsFileError, match=r"/id_ed25519 is not a PEM private key$") as refused:
        read_tls_files(chain, key, None)
    assert refused.value.file is TlsFile.PRIVATE_KEY


def test_a_key_that_is_not_the_certificates_is_refused_naming_both(tmp_path: Path) -> None:
    chain, _ = self_signed(tmp_path, "server")
    _, other_key = self_signed(tmp_path, "other")
    with pytest.raises(
        TlsFileError, match=r"/other-key.pem is not the private key of .*/server.pem \(KEY_VALUES_MISMATCH\)$"
    ) as refused:
        read_tls_files(chain, other_key, None)
    assert refused.value.file is TlsFile.PRIVATE_KEY


def test_a_key_of_another_type_than_the_certificates_is_said_so(tmp_path: Path) -> None:
    """An RSA key for an EC certificate: OpenSSL files the key beside the certificate, not under it, and
    its reason, NO_CERTIFICATE_ASSIGNED, read as if no certificate had been given."""
    chain, _ = self_signed(tmp_path, "server")  # EC (P-256)
    key = tmp_path / "rsa-key.pem"
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    key.write_bytes(rsa_key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    said = r"/rsa-key.pem is not the private key of .*/server.pem \(a key of another type\)$"
    with pytest.raises(TlsFileError, match=said) as refused:
        read_tls_files(chain, key, None)
    assert refused.value.file is TlsFile.PRIVATE_KEY


def test_an_encrypted_key_is_refused_without_asking_for_its_password(tmp_path: Path) -> None:
    """gRPC takes no password, and OpenSSL, given no way to ask for one, prompted on the terminal (a start
    waited for an answer) or, with none, raised OSError 22."""
    chain, key = self_signed(tmp_path, "server", BestAvailableEncryption(b"secret"))
    said = r"/server-key.pem is encrypted: gRPC takes no password"
    with pytest.raises(TlsFileError, match=said) as refused:
        read_tls_files(chain, key, None)
    assert refused.value.file is TlsFile.PRIVATE_KEY


def _without_memfd(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """The key check's memory as a system may withhold it: no memfd_create (not Linux), one a seccomp
    filter refuses (EPERM), or one whose /proc/self/fd path names nothing (/proc not mounted: a chroot,
    a bare container; OpenSSL then found no file, a FileNotFoundError traceback)."""
    if how == "no memfd":
        monkeypatch.delattr(os, "memfd_create")
    elif how == "memfd refused":
        monkeypatch.setattr(os, "memfd_create", memfd_refused)
    else:
        exists = os.path.exists
        monkeypatch.setattr(
            os.path, "exists", lambda path: not str(path).startswith("/proc/") and exists(path)
        )


@pytest.mark.parametrize("how", ["no memfd", "memfd refused", "no /proc"])
def test_the_key_is_checked_in_a_private_folder_removed_after_where_memfd_is_missing_or_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """OpenSSL's key check takes paths only; memfd (Linux) keeps the bytes read in memory, elsewhere
    they are written to a temporary folder of this process's, and removed. A seccomp filter may refuse
    memfd_create (EPERM) where os has it: the check was then a PermissionError traceback, and a TLS
    server could not start."""
    _without_memfd(monkeypatch, how)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    chain, key = self_signed(tmp_path, "server")
    _, other_key = self_signed(tmp_path, "other")
    assert read_tls_files(chain, key, None).private_key == key.read_bytes()
    with pytest.raises(TlsFileError, match=r"is not the private key of .* \(KEY_VALUES_MISMATCH\)$"):
        read_tls_files(chain, other_key, None)
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize("how", ["no memfd", "memfd refused", "no /proc"])
def test_a_key_check_with_no_memfd_and_no_writable_temporary_folder_says_to_set_tmpdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Where neither memfd nor a temporary folder can hold the files (a read-only /tmp: here TMPDIR a
    folder that is not there), the check was a FileNotFoundError traceback out of every TLS start."""
    _without_memfd(monkeypatch, how)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    chain, key = self_signed(tmp_path, "server")
    said = (
        r"/server-key.pem cannot be checked against .*/server.pem: OpenSSL reads a key from a file only, "
        r"memfd \(with /proc/self/fd\) is not available here and no temporary folder could be made "
        r"\(.*/gone/tandem-pem-\w+: No such file or directory\): set TMPDIR to a writable folder$"
    )
    with pytest.raises(TlsFileError, match=said) as refused:
        read_tls_files(chain, key, None)
    assert refused.value.file is TlsFile.PRIVATE_KEY


def test_a_thousand_key_checks_leave_no_file_descriptor_open(tmp_path: Path) -> None:
    chain, key = self_signed(tmp_path, "server")
    _, other_key = self_signed(tmp_path, "other")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(500):
        read_tls_files(chain, key, chain)
        with pytest.raises(TlsFileError):
            read_tls_files(chain, other_key, None)
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("file", list(TlsFile))
def test_each_pem_file_is_bounded_at_1_mib_naming_what_it_is(tmp_path: Path, file: TlsFile) -> None:
    path = tmp_path / "big.pem"
    path.write_bytes(b"#" * (MAX_PEM_FILE_BYTES + 1))
    paths = {f: (path if f is file else None) for f in TlsFile}
    with pytest.raises(TlsFileError, match=rf"is over 1,048,576 bytes, the bound of {file.value} \(1 MiB\)$"):
        read_tls_files(paths[TlsFile.CERTIFICATE_CHAIN], paths[TlsFile.PRIVATE_KEY], paths[TlsFile.CA_BUNDLE])


def test_a_key_is_checked_where_proc_is_not_mounted(tmp_path: Path) -> None:
    """For real, in a mount namespace of its own with an empty /proc (where root may make one: else
    skipped, and the "no /proc" cases above stand in): OpenSSL opened /proc/self/fd/N and raised
    FileNotFoundError, a traceback out of every TLS start in a chroot or a bare container."""
    empty_proc = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs none /proc && exec "$@"', "sh"]
    if (
        shutil.which("unshare") is None
        or subprocess.run([*empty_proc, "true"], capture_output=True).returncode
    ):
        pytest.skip("cannot mount an empty /proc here (unshare needs root)")
    chain, key = self_signed(tmp_path, "server")
    _, other_key = self_signed(tmp_path, "other")
    script = (
        "from tandem.client.flag_files import TlsFileError, read_tls_files\n"
        f"read_tls_files({str(chain)!r}, {str(key)!r}, None)\n"
        f"try:\n    read_tls_files({str(chain)!r}, {str(other_key)!r}, None)\n"
        "except TlsFileError as error:\n    print(error)\n"
    )
    done = subprocess.run(
        [*empty_proc, sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith(f"is not the private key of {chain} (KEY_VALUES_MISMATCH)\n")
