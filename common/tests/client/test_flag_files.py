"""Files a flag names are read only as a regular file within a bound, and a CA bundle only as PEM; each
refusal names the path and what is wrong with it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.client.flag_files import MAX_CA_BUNDLE_BYTES, read_bounded, read_ca_bundle


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
    assert bundle.stat().st_size < MAX_CA_BUNDLE_BYTES
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
    path.write_bytes(b"#" * (MAX_CA_BUNDLE_BYTES + 1))
    with pytest.raises(ValueError, match=r"is over 1,048,576 bytes, the bound of a CA bundle \(1 MiB\)$"):
        read_ca_bundle(path)
