"""`tandem wait`: a target or a timeout it cannot use is refused at once, naming it, exit 2."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.tests.client.pem_files import memfd_refused, self_signed
from tandem import cli


@pytest.mark.parametrize(
    "target", ["", "::::", "127.0.0.1:116328", "http://", "http://x:99999/health", "a:1,b:2"]
)
def test_a_target_that_is_not_an_address_is_refused_at_once(
    target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each was probed until --timeout-s passed, then exit 1 with gRPC's trace lines (port 116328
    reached port 50792)."""
    began = time.monotonic()
    assert cli.main(["wait", "--timeout-s", "30", target]) == 2
    assert time.monotonic() - began < 5
    assert f"tandem wait: TARGET {target!r}: " in capsys.readouterr().err


# The one refusal of a number --timeout-s does not take, whatever bound it breaks.
BOUND = (
    "tandem wait: --timeout-s (TANDEM_WAIT_TIMEOUT_S): must be a number of seconds above 0 and at most "
    "31,536,000 (a year), or inf for no limit"
)


@pytest.mark.parametrize("timeout", ["nan", "-inf", "-1"])
def test_a_timeout_that_is_not_a_number_of_seconds_or_inf_is_refused(
    timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """click.FloatRange(min=0) took NaN: the wait never ended."""
    assert cli.main(["wait", "--timeout-s", timeout, "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == f"{BOUND}, got {timeout!r}\n"


@pytest.mark.parametrize("timeout", ["0", "0.0", "-0"])
def test_a_timeout_of_0_is_refused_pointing_at_inf(timeout: str, capsys: pytest.CaptureFixture[str]) -> None:
    """wait-for-it's -t 0 waits for ever; here 0 probed once and exit 1 a moment later: a script ported
    from wait-for-it failed where it meant to wait. Either meaning surprises someone, so neither is taken."""
    assert cli.main(["wait", "--timeout-s", timeout, "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == (
        f"{BOUND}, got {timeout!r} (wait-for-it's -t 0 waits for ever; inf does that here)\n"
    )


@pytest.mark.parametrize("timeout", ["inf", "Infinity", "+inf", " INF "])
def test_a_timeout_of_inf_waits_with_no_limit(
    timeout: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`timeout 0` and `wait-for-it -t 0` wait for ever; `tandem wait` refused inf as not finite."""
    from tandem import readiness

    asked: list[float | None] = []

    def wait(self: readiness.Probe, timeout_s: float | None, stop: object = None) -> dict[str, str]:
        asked.append(timeout_s)
        return {}  # every target serves

    monkeypatch.setattr(readiness.Probe, "wait", wait)
    assert cli.main(["wait", "--timeout-s", timeout, "127.0.0.1:1"]) == 0
    assert asked == [None]  # Probe.wait's no deadline
    assert capsys.readouterr().out == "serving: 127.0.0.1:1\n"


@pytest.mark.parametrize("timeout", ["1e308", "31536001", "1e309", "1e400"])
def test_a_timeout_over_a_year_is_refused_pointing_at_inf(
    timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """1e308 was taken and probed with no end, where the script asked for a bound; threading's waits
    raise OverflowError from about 1e10 s, so no wait could have been given it. 1e400, which float()
    reads as inf, was refused in other words ("above 0") than 1e308 ("at most a year")."""
    began = time.monotonic()
    assert cli.main(["wait", "--timeout-s", timeout, "127.0.0.1:1"]) == 2
    assert time.monotonic() - began < 5
    assert capsys.readouterr().err == f"{BOUND}, got {timeout!r}\n"


def test_a_timeout_of_a_year_is_waited_for_and_any_wait_can_take_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from tandem import readiness
    from tandem.wait_cli import MAX_TIMEOUT_S

    asked: list[float | None] = []

    def wait(self: readiness.Probe, timeout_s: float | None, stop: object = None) -> dict[str, str]:
        asked.append(timeout_s)
        return {}

    monkeypatch.setattr(readiness.Probe, "wait", wait)
    assert cli.main(["wait", "--timeout-s", "31536000", "127.0.0.1:1"]) == 0
    assert asked == [MAX_TIMEOUT_S] == [31_536_000.0]
    assert MAX_TIMEOUT_S <= threading.TIMEOUT_MAX
    assert threading.Lock().acquire(timeout=MAX_TIMEOUT_S)  # a free lock: at once, where 1e10 overflows


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (b"garbage\n", "is not a PEM certificate"),
        (b"#" * (1024 * 1024 + 1), "is over 1,048,576 bytes, the bound of a CA bundle (1 MiB)"),
    ],
)
def test_a_tls_ca_it_cannot_use_is_refused_at_once(
    tmp_path: Path, text: bytes, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """gRPC logged "Could not load any root certificate", and the wait ran its whole timeout to say
    "Connection refused", exit 1."""
    ca = tmp_path / "ca.pem"
    ca.write_bytes(text)
    began = time.monotonic()
    assert cli.main(["wait", "--timeout-s", "30", "--tls-ca", str(ca), "127.0.0.1:1"]) == 2
    assert time.monotonic() - began < 5
    assert capsys.readouterr().err == f"tandem wait: --tls-ca (TANDEM_WAIT_TLS_CA): {ca} {said}\n"


def test_a_device_as_tls_ca_is_refused_before_reading_it(capsys: pytest.CaptureFixture[str]) -> None:
    # /dev/zero, read whole, passed 3 GB in 3 s.
    assert cli.main(["wait", "--timeout-s", "30", "--tls-ca", "/dev/zero", "127.0.0.1:1"]) == 2
    said = capsys.readouterr().err
    assert said == "tandem wait: --tls-ca (TANDEM_WAIT_TLS_CA): /dev/zero is not a regular file\n"


def test_a_key_that_cannot_be_checked_here_names_the_flag_and_tmpdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """memfd refused (a seccomp filter) and no temporary folder to be had (a read-only /tmp): the key
    check was a FileNotFoundError traceback, exit 1."""
    chain, key = self_signed(tmp_path, "client")
    monkeypatch.setattr(os, "memfd_create", memfd_refused)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    assert cli.main(["wait", "--tls-cert", str(chain), "--tls-key", str(key), "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"tandem wait: --tls-key (TANDEM_WAIT_TLS_KEY): {key} cannot be checked against {chain}"
    )
    assert err.endswith(": set TMPDIR to a writable folder\n")
    assert err.count("\n") == 1


@contextlib.contextmanager
def _answering(reply: bytes) -> Iterator[int]:
    """A port on 127.0.0.1 answering each connection `reply`, then closing it."""
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def answer() -> None:
            with contextlib.suppress(OSError):
                while True:
                    connection, _ = listener.accept()
                    with connection:
                        connection.sendall(reply)

        threading.Thread(target=answer, daemon=True).start()
        yield listener.getsockname()[1]


def test_an_http_target_that_answers_no_http_is_waited_on_like_any_other(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A gRPC port given as `http://.../health` answered bytes no HTTP status line reads: a BadStatusLine
    traceback (57 lines). Now it is a target not serving yet, and the wait ends at its timeout."""
    with _answering(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00garbage\r\n\r\n") as port:
        target = f"http://127.0.0.1:{port}/health"
        assert cli.main(["wait", "--timeout-s", "0.5", target]) == 1
    assert capsys.readouterr().err.endswith(f"{target}: not an HTTP answer (BadStatusLine)\n")


def test_tls_flags_with_a_plain_http_target_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """urllib probed it in plain HTTP, --tls ignored without a word."""
    assert cli.main(["wait", "--tls", "http://127.0.0.1:8000/health"]) == 2
    assert capsys.readouterr().err == (
        "tandem wait: TARGET 'http://127.0.0.1:8000/health': --tls and its files are for gRPC targets; an "
        "http:// URL is plain HTTP (an https:// one is checked against the system's CAs)\n"
    )


def test_a_tls_probe_of_a_plaintext_port_is_one_line() -> None:
    """gRPC core logged each failed handshake ("I1208 ... ssl_transport_security.cc ... Handshake
    failed"), 7 lines in 2 s before the one line that says it."""
    with _answering(b"HTTP/1.1 400 Bad Request\r\n\r\n") as port:
        env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
        tandem = "from tandem import cli; raise SystemExit(cli.main())"
        argv = ["wait", "--tls", "--timeout-s", "1", f"127.0.0.1:{port}"]
        done = subprocess.run(
            [sys.executable, "-c", tandem, *argv], env=env, capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 1
    assert done.stderr.startswith(f"tandem wait: not serving after 1 s: 127.0.0.1:{port}: UNAVAILABLE: ")
    assert done.stderr.count("\n") == 1
