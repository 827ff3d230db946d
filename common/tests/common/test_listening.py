"""Where a server listens: every address gRPC binds for a --host is checked, one port free at each,
and what refuses is named in one line by its flag."""

from __future__ import annotations

import errno
import socket

import pytest

from common.tests.common.listeners import has_ipv6_loopback, listener
from tandem.client.errors import ConfigError
from tandem.common import listening
from tandem.common.listening import check_port_free, free_port, is_localhost, listen_plan

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

    def refused(family: socket.AddressFamily, address: str, port: int) -> socket.socket:
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
    second = listen_plan("localhost").addresses[1]
    with listener(*second) as other:
        taken = other.getsockname()[1]
        picks: list[int] = []
        real_pick = listening._kernel_pick

        def pick_taken_first(address: tuple[socket.AddressFamily, str]) -> socket.socket:
            probe = real_pick(address) if picks else listening._probe(*address, taken)
            picks.append(probe.getsockname()[1])
            return probe

        monkeypatch.setattr(listening, "_kernel_pick", pick_taken_first)
        port = free_port("localhost")
    assert picks[0] == taken and port == picks[-1] != taken


def test_port_0_on_one_address_is_left_to_the_kernel() -> None:
    """No window between a check and the bind where one socket is all there is."""
    assert free_port("127.0.0.1") == 0
