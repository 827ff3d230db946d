"""`tandem serve openai` refuses what it cannot use as one line naming the flag, exit 2: each
--upstream-* file by its own flag, and a host the listen itself refuses."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from tandem.client.errors import ConfigError
from tandem.gateway.__main__ import config_from_args, listen, main
from tandem.gateway.config import GatewayConfig


def _config(args: list[str]) -> GatewayConfig:
    return config_from_args(args)


def test_each_upstream_file_refused_is_named_by_its_own_flag(tmp_path: Path) -> None:
    """Every refusal was said of --upstream-tls-ca: a token file not found, a certificate without its key."""
    pem = tmp_path / "client.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    missing = str(tmp_path / "missing")
    for args, field in (
        (["--upstream-tls-cert", str(pem)], "upstream_tls_key"),
        (["--upstream-tls-key", str(pem)], "upstream_tls_cert"),
        (["--upstream-auth-token-file", missing], "upstream_auth_token_file"),
        (["--upstream-tls-ca", missing], "upstream_tls_ca"),
        (["--upstream-tls-cert", missing, "--upstream-tls-key", str(pem)], "upstream_tls_cert"),
    ):
        with pytest.raises(ConfigError) as error:
            _config(args)
        assert error.value.field == field, args


@pytest.mark.parametrize(
    ("text", "said"), [(b"garbage\n", "is not a PEM certificate"), (None, "is not a regular file")]
)
def test_an_upstream_ca_it_cannot_use_is_refused_before_listening(
    tmp_path: Path, text: bytes | None, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The gateway listened with a CA that held no certificate, and every call then failed to connect;
    /dev/zero was read whole."""
    ca = tmp_path / "ca.pem"
    if text is None:
        ca = Path("/dev/zero")
    else:
        ca.write_bytes(text)
    assert main(["--upstream-tls-ca", str(ca)]) == 2
    assert capsys.readouterr().err == (
        f"tandem serve openai: --upstream-tls-ca (TANDEM_OPENAI_UPSTREAM_TLS_CA): {ca} {said}\n"
    )


def test_a_certificate_without_its_key_names_the_upstream_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--upstream-tls-cert", "/etc/hostname"]) == 2
    assert capsys.readouterr().err == (
        "tandem serve openai: --upstream-tls-key (TANDEM_OPENAI_UPSTREAM_TLS_KEY): --upstream-tls-cert and "
        "--upstream-tls-key go together (mutual TLS)\n"
    )


def test_a_host_the_listen_refuses_is_a_flag_error_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # An address of another host (TEST-NET-1, RFC 5737) with port 0 was an OSError traceback, exit 1,
    # after the flags had passed; the check now refuses it before anything starts.
    assert main(["--host", "192.0.2.1", "--port", "0", "--body-workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem serve openai: --host (TANDEM_OPENAI_HOST) cannot listen on 192.0.2.1: ")
    assert err.count("\n") == 1


def _has_ipv6_loopback() -> bool:
    """Whether ::1 can be bound here (socket.has_ipv6 says how Python was built, not the machine)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no ::1 on this machine: localhost is one address")
async def test_port_0_on_a_host_of_two_addresses_listens_on_one_port_at_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where /etc/hosts names localhost ::1 and 127.0.0.1, asyncio bound each on a kernel's pick of its
    own and the gateway said the first socket's port: callers of the other address found nothing."""
    real_getaddrinfo = socket.getaddrinfo

    def both_loopbacks(host, port, *args, **kwargs):  # type: ignore[no-untyped-def]
        if host != "localhost":
            return real_getaddrinfo(host, port, *args, **kwargs)
        return [
            *real_getaddrinfo("::1", port, socket.AF_INET6, socket.SOCK_STREAM),
            *real_getaddrinfo("127.0.0.1", port, socket.AF_INET, socket.SOCK_STREAM),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", both_loopbacks)
    listener = await listen(lambda: asyncio.Protocol(), "localhost", 0)  # type: ignore[arg-type]
    try:
        hosts = {sock.getsockname()[0] for sock in listener.sockets}
        ports = {sock.getsockname()[1] for sock in listener.sockets}
        assert hosts == {"::1", "127.0.0.1"} and len(ports) == 1
    finally:
        listener.close()
        await listener.wait_closed()
