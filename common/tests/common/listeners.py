"""Sockets standing for another process's listener, and whether this machine has ::1."""

from __future__ import annotations

import socket

import pytest

from tandem.common import listening


def listener(family: socket.AddressFamily, address: str, port: int = 0) -> socket.socket:
    """A socket listening on address:port (the kernel's pick for 0), as another process's would."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen()
    return sock


def has_ipv6_loopback() -> bool:
    """Whether ::1 can be bound here: Python built with IPv6 (socket.has_ipv6) says nothing of the
    machine (a container with IPv6 off has none)."""
    try:
        listener(socket.AF_INET6, "::1").close()
    except OSError:
        return False
    return True


def second_loopback() -> socket.socket:
    """A listener, as another process's, on the loopback gRPC binds second for localhost."""
    return listener(*listening.listen_plan("localhost").addresses[1])


def pick_taken_first(monkeypatch: pytest.MonkeyPatch, taken: int) -> list[int]:
    """The kernel's first pick for a port 0 made `taken` (free at the first address, held at another);
    its later picks its own. The ports picked, as they come."""
    picks: list[int] = []
    real_pick = listening._kernel_pick

    def pick(address: tuple[socket.AddressFamily, str], v6only: bool = False) -> socket.socket:
        probe = real_pick(address, v6only) if picks else listening._probe(*address, taken)
        picks.append(probe.getsockname()[1])
        return probe

    monkeypatch.setattr(listening, "_kernel_pick", pick)
    return picks


def pick_taken_before_the_bind(monkeypatch: pytest.MonkeyPatch, server_module: object, taken: int) -> None:
    """start_server's first port-0 pick made `taken`, as if another process took it at one address
    between the pick and gRPC's bind; its later picks its own."""
    picked = iter([taken])
    monkeypatch.setattr(
        server_module, "free_port_of", lambda plan: next(picked, 0) or listening.free_port_of(plan)
    )
