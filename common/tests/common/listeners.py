"""Sockets standing for another process's listener, and whether this machine has ::1."""

from __future__ import annotations

import socket


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
