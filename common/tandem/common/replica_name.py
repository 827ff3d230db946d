"""Which replica answered a call: a server's own name, sent in its reply's initial metadata, and the name
a caller's errors give it.

A caller balancing over several servers (`--encoder a:1,b:2`, or `dns:///name:port`: gRPC's round_robin
in one channel, `tandem.client.channel`) cannot tell which of them answered: grpc.aio's client call has
no `peer()`, and the balancing happens inside gRPC. Its errors named the whole list ("encoder
127.0.0.1:44001,127.0.0.1:45621 serves model 'tiny-other'"), leaving the operator to find the wrong one
of n. So the server says who it is, in the initial metadata it sends as a call begins (before any work:
a call that then hangs or fails still carries it), and the caller names that replica. Where none is
known (no reply at all: every replica unreachable; a server from before it said), the list is named.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence

from tandem.client.addresses import dns_name

HEADER = "tandem-replica"  # initial metadata: the answering server's own name, `own_name`'s
# The most characters of a reported name kept: a host name is at most 253, a port 5 more. Anything may
# answer on a configured address; its name goes into error text, so it is cut and held to printable ASCII.
MAX_NAME_CHARS = 262


def own_name(host: str, port: int) -> str:
    """A server's name as its callers would write it: its listen address, or where it listens on every
    interface (0.0.0.0, ::, a container's), this host's name (a Kubernetes pod's), with the port."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"{host}:{port}"
    if ip.is_unspecified:
        return f"{socket.gethostname()}:{port}"
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def reported(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The name a reply's initial metadata carries; None where it carries none."""
    for key, value in metadata or ():
        if key == HEADER:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            return "".join(c if " " < c <= "~" else "?" for c in text[:MAX_NAME_CHARS]) or None
    return None


def answering(address: str, name: str | None) -> str:
    """The replica to name in an error about a call to `address` (as configured: one server, a list, or
    dns:///) that the server called `name` answered: the list's entry that is that server (its own name,
    or the only entry on its port: 127.0.0.1 listening, localhost configured), else its own name with
    the address it is one of. `address` itself where no name is known, or where it names one server."""
    if not name:
        return address
    entries = [entry.strip() for entry in address.split(",")]
    is_name = _is_dns_name(address)  # one entry, yet every server its name resolves to
    if len(entries) == 1 and not is_name:
        return address  # one server: it answered, as the caller names it
    if name in entries:
        return name
    port = name.rpartition(":")[2]
    on_port = [entry for entry in entries if entry.rpartition(":")[2] == port]
    if len(on_port) == 1 and not is_name:
        return on_port[0]
    return f"{name} (of {address})"


def _is_dns_name(address: str) -> bool:
    # An error's words must not fail: a dns: target dns_name refuses (no channel opens to it) is still a
    # name gRPC would resolve (port 99999 wrapped, mod 65536), so it is named as one.
    try:
        return dns_name(address) is not None
    except ValueError:
        return True
