"""Ports for the servers the tests start on 127.0.0.1: below the kernel's ephemeral range, each
pytest-xdist worker in a slice of its own.

A port the kernel picks (a bind to port 0) comes from the ephemeral range (net.ipv4.ip_local_port_range,
32768-60999 by default), the range every outgoing connection and every server asked for port 0 draws
from too: between the pick and the server's own bind, another worker's connection or server could take
it (a clean-clone `make test` on two workers lost a decoder so: "--port 43003 is in use on 127.0.0.1").
Below the range only explicit binds land, and each worker picks in its own slice, in turn, so a port a
test just gave up is not picked again soon.
"""

from __future__ import annotations

import os
import random
import socket

LOW, HIGH = 20_000, 32_768  # under Linux's default ephemeral range


def _slice() -> range:
    """This worker's ports: the range cut in PYTEST_XDIST_WORKER_COUNT slices, gwN taking the Nth."""
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) % count if worker.isdigit() else 0
    size = (HIGH - LOW) // count
    return range(LOW + index * size, LOW + (index + 1) * size)


_PORTS = _slice()
_next = random.randrange(len(_PORTS))  # two sessions at once start apart


def free_port() -> int:
    """A port of this worker's slice that nothing is bound to on 127.0.0.1 now."""
    global _next
    for _ in range(len(_PORTS)):
        port = _PORTS[_next % len(_PORTS)]
        _next += 1
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue  # held, or lingering in TIME_WAIT: the next one
            return port
    raise RuntimeError(f"no port of {_PORTS.start}..{_PORTS.stop - 1} is free on 127.0.0.1")
