"""Where a server listens: every address gRPC binds for a --host is checked, one port free at each,
and what refuses is named in one line by its flag."""

from __future__ import annotations

import errno
import socket

import pytest

from common.tests.common.listeners import has_ipv6_loopback, listener, pick_taken_first, second_loopback
from tandem.client.errors import ConfigError
from tandem.common import listening
from tandem.common.listening import asyncio_plan, check_port_free, free_port, is_localhost, listen_plan

needs_ipv6_loopback = pytest.mark.skipif(
    not has_ipv6_loopback(), reason="no ::1 on this machine: localhost is one address"
)


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST", "localhost.", "api.localhost"])
def test_localhost_in_any_spelling_is_both_loopbacks(host: str) -> None:
    """gRPC's resolver answers each with ::1 and 127.0.0.1; only "localhost" itself was checked so."""
    assert is_localhost(host)
    expected = [a for a in listening.LOOPBACKS if a[1] != "::1" or has_ipv6_loopback()]
    assert list(listen_plan(host).addresses) == expected


@needs_ipv6_loopback
@pytest.mark.parametrize("host", ["localhost", "LocalHost", "api.localhost"])
def test_a_port_another_process_holds_on_one_loopback_is_refused_naming_that_address(host: str) -> None:
    """The check bound the first address localhost resolves to; gRPC then listened on the other alone
    and callers of the taken one reached the process that held it."""
    with listener(socket.AF_INET6, "::1") as other:
        port = other.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            check_port_free(host, port)
    assert caught.value.field == "port"
    assert caught.value.reason == f"{port} is in use on {host} (::1): another process listens there"


@needs_ipv6_loopback
def test_the_ipv4_wildcard_is_checked_as_the_dual_stack_socket_grpc_binds() -> None:
    """gRPC binds "0.0.0.0" as "::" (both families): with the port held on ::1 it fell back to IPv4
    alone and the check, an IPv4 probe, had passed."""
    with listener(socket.AF_INET6, "::1") as other:
        port = other.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            check_port_free("0.0.0.0", port)
    assert caught.value.field == "port" and caught.value.reason.startswith(f"{port} is in use on 0.0.0.0:")


def test_an_ipv6_address_in_a_refusal_is_in_brackets() -> None:
    with listener(socket.AF_INET, "127.0.0.1") as other:
        port = other.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            check_port_free("::", port)  # the dual-stack wildcard holds IPv4 too
    assert caught.value.reason == f"{port} is in use on [::]: another process listens there"


def test_a_port_that_needs_privileges_is_said_of_the_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port under 1024 for a user without the capability was said of --host."""

    def refused(family: socket.AddressFamily, address: str, port: int, v6only: bool = False) -> socket.socket:
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(listening, "_probe", refused)
    with pytest.raises(ConfigError) as caught:
        check_port_free("127.0.0.1", 80)
    assert (caught.value.field, caught.value.reason) == (
        "port",
        "80 needs privileges on 127.0.0.1: Permission denied",
    )


def test_a_name_that_does_not_resolve_is_said_of_the_host() -> None:
    with pytest.raises(ConfigError) as caught:
        check_port_free("no.such.invalid", 0)
    assert caught.value.field == "host" and caught.value.reason.startswith(
        "'no.such.invalid' does not resolve"
    )


@needs_ipv6_loopback
def test_port_0_on_localhost_is_a_port_free_at_both_loopbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's pick for the first address was used for the others as it came."""
    with second_loopback() as other:
        picks = pick_taken_first(monkeypatch, taken := other.getsockname()[1])
        port = free_port("localhost")
    assert picks[0] == taken and port == picks[-1] != taken


def test_port_0_on_one_address_is_left_to_the_kernel() -> None:
    """No window between a check and the bind where one socket is all there is."""
    assert free_port("127.0.0.1") == 0


def test_an_address_this_machine_lacks_is_refused_before_anything_binds() -> None:
    """--host 192.0.2.1 (TEST-NET-1) with port 0 passed the check and gRPC's own error came after the
    model had loaded."""
    with pytest.raises(ConfigError) as caught:
        check_port_free("192.0.2.1", 0)
    assert caught.value.field == "host" and caught.value.reason.startswith("cannot listen on 192.0.2.1: ")


@pytest.mark.parametrize(
    ("addresses", "kept"),
    [
        (["0.0.0.0", "127.0.0.1"], ["0.0.0.0"]),
        (["::", "127.0.0.1"], ["::"]),
        (["127.0.0.1", "::ffff:127.0.0.1"], ["127.0.0.1"]),
    ],
)
def test_a_name_whose_addresses_overlap_binds_each_socket_once(
    monkeypatch: pytest.MonkeyPatch, addresses: list[str], kept: list[str]
) -> None:
    """A name answering a wildcard and an address it holds (or one address twice, IPv4-mapped) was
    refused "in use ... another process listens there": the server's sockets collided with each
    other, and port 0 built the server 64 times."""
    real = socket.getaddrinfo

    def overlapping(host, port, *args, **kwargs):  # type: ignore[no-untyped-def]
        if host != "overlap.test":
            return real(host, port, *args, **kwargs)
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
            for a in addresses
        ]

    monkeypatch.setattr(socket, "getaddrinfo", overlapping)
    if "::" in addresses and not has_ipv6_loopback():
        pytest.skip("no IPv6 on this machine")
    assert [address for _, address in listen_plan("overlap.test").addresses] == kept
    with listener(socket.AF_INET, "127.0.0.1") as closed:
        port = closed.getsockname()[1]  # free again once closed
    check_port_free("overlap.test", port)


@needs_ipv6_loopback
def test_the_gateways_asyncio_listen_is_checked_as_asyncio_binds() -> None:
    """asyncio binds "0.0.0.0" as IPv4 alone and each IPv6 socket IPv6 alone: the gateway's check,
    modelled on gRPC's dual-stack "::", refused ports asyncio could bind."""
    with listener(socket.AF_INET6, "::1") as other:
        port = other.getsockname()[1]
        check_port_free("0.0.0.0", port, asyncio_plan("0.0.0.0"))
        with pytest.raises(ConfigError):
            check_port_free("0.0.0.0", port)  # gRPC's "0.0.0.0" is "::", both families


def test_the_gateways_plan_adds_nothing_to_what_localhost_resolves_to() -> None:
    """asyncio asks getaddrinfo; gRPC's resolver answers the loopbacks itself, so --host localhost. or
    api.localhost passed `tandem up`'s check and the gateway then failed to resolve it."""
    resolved = {address for *_, (address, *_) in socket.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)}
    assert {address for _, address in asyncio_plan("localhost").addresses} == resolved
    if not _resolves("api.localhost"):
        with pytest.raises(ConfigError) as caught:
            asyncio_plan("api.localhost")
        assert caught.value.field == "host"


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 0)
    except socket.gaierror:
        return False
    return True
