"""What an address names: the gRPC target a channel dials, and the server a span says it called.

An address is "host:port" (one server), several of them ("a:1,b:2" or a list: balanced, host names
resolved once, here), `dns:///name:port` (every address the name resolves to, re-resolved by gRPC), or
one of gRPC's own schemes (`unix:`, `ipv4:`, ...), passed as written. Each is checked here, before
gRPC sees it: gRPC itself takes a bad port or host without a word (see `channel_target`).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass


def channel_target(address: str | Sequence[str]) -> tuple[str, bool]:
    """The gRPC target of `address`, and whether it names several servers (then it is balanced).

    "host:port" is one server. "a:1,b:2" (or a list) is several: gRPC's static `ipv4:`/`ipv6:`
    list, host names resolved once, here. "dns:///name:port" is every address the name resolves to,
    re-resolved by gRPC as servers come and go. Raises ValueError for an address it cannot use.
    """
    addresses = [a.strip() for a in (address.split(",") if isinstance(address, str) else address)]
    if not addresses or not all(addresses):
        raise ValueError(f"address {address!r}: expected host:port, several separated by commas, or dns:///")
    if len(addresses) == 1:
        if dns_name(addresses[0]) is not None:  # checked as the gateway checks it: gRPC wraps its port too
            return addresses[0], True
        scheme = next((s for s in _GRPC_SCHEMES if addresses[0].startswith(s)), None)
        if scheme is None:
            _host_port(addresses[0])  # gRPC took port 116328 as 50792 (mod 65536), and "::::" as a name
        elif scheme in ("ipv4:", "ipv6:"):
            _host_port(addresses[0].removeprefix(scheme))  # the same wrap happens behind these
        return addresses[0], False
    resolved = [_ip_address(a) for a in addresses]
    families = {ip.version for ip, _ in resolved}
    if len(families) > 1:
        raise ValueError(f"address {address!r}: mixes IPv4 and IPv6 servers; gRPC balances one family")
    if families == {4}:
        return "ipv4:" + ",".join(f"{ip}:{port}" for ip, port in resolved), True
    return "ipv6:" + ",".join(f"[{ip}]:{port}" for ip, port in resolved), True


def server_of(address: str | Sequence[str]) -> tuple[str, int | None] | None:
    """The server `address` names, as the semantic conventions' `server.address` and `server.port`: a
    host:port's host and port, a dns: target's name and port (the group its addresses serve; without a
    port, gRPC's default for the name, 443, the port its calls go to), a unix socket's path (no port);
    None for several servers (no one of them is the call's) or another form."""
    addresses = [a.strip() for a in (address.split(",") if isinstance(address, str) else address)]
    if len(addresses) != 1:
        return None
    (target,) = addresses
    if target.startswith("unix:"):  # unix:path, or unix:///absolute/path (an empty authority)
        path = target.removeprefix("unix:")
        return (path[2:] if path.startswith("///") else path), None
    if target.startswith("unix-abstract:"):
        return target.removeprefix("unix-abstract:"), None
    try:
        name = dns_name(target)
    except ValueError:
        return None
    if name is not None:
        target = name.host_port
    elif target.startswith("ipv6:"):  # a URI: a zone's "%" is written %25 (fe80::1%25eth0)
        target = urllib.parse.unquote(target.removeprefix("ipv6:"))
    else:
        target = target.removeprefix("ipv4:")
    try:
        return _host_port(target)
    except ValueError:
        return None


@dataclass(frozen=True)
class DnsName:
    """A `dns:` target as gRPC's resolver reads it: the name it resolves, and which DNS server asks."""

    host: str  # a host name or an IP address as written; an IPv6 one in brackets ("[::1]")
    port: int  # as written, else DNS_DEFAULT_PORT
    resolver: str  # the DNS server named (dns://8.8.8.8/name:port); "" for the system's resolver

    @property
    def host_port(self) -> str:
        return f"{self.host}:{self.port}"


def dns_name(address: str) -> DnsName | None:
    """The name a `dns:` target resolves, in each form gRPC reads: dns:host:port, dns:/host:port,
    dns:///host:port, dns://resolver/host:port; the port DNS_DEFAULT_PORT where none is written, an IPv6
    address with or without brackets (then without a port). None for another address. Raises ValueError
    for a host that is no name or IP address, or a port outside 1..65535 (gRPC wraps it, mod 65536)."""
    if not address.startswith("dns:"):
        return None
    rest, resolver = address.removeprefix("dns:"), ""
    if rest.startswith("//"):  # a URI's authority, then its path
        resolver, _, rest = rest[2:].partition("/")
    else:
        rest = rest.removeprefix("/")  # gRPC's resolver takes the path without its leading "/"
    if rest.startswith("["):
        host, bracket, after = rest.partition("]")
        if not bracket or (after and not after.startswith(":")):
            raise ValueError(f"address {address!r}: names no host; expected dns:///host:port")
        host, port = host + bracket, after.removeprefix(":") if after else str(DNS_DEFAULT_PORT)
    elif rest.count(":") > 1:  # an IPv6 address without brackets, so without a port
        host, port = f"[{rest}]", str(DNS_DEFAULT_PORT)
    else:
        host, colon, port = rest.partition(":")
        port = port if colon else str(DNS_DEFAULT_PORT)
    if not host:
        raise ValueError(f"address {address!r}: names no host; expected dns:///host:port")
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"address {address!r}: {host} is not an IPv6 address in brackets") from None
    elif not _HOST_NAME.fullmatch(host):
        raise ValueError(f"address {address!r}: {host!r} is not a host name or an IP address")
    # ASCII digits only: other scripts' are digits to isdigit ('²' failed int(), '٨٠' was read as 80);
    # at most 5 of them before int(), which refuses 4,300 in words of its own.
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
        raise ValueError(f"address {address!r}: port {port!r} is not a port (1..65535)")
    return DnsName(host, int(port), resolver)


# The port gRPC's dns resolver gives a name without one, plaintext or not (C-core's kDefaultSecurePort,
# "https"; its naming doc: "If not specified, 443 is used").
DNS_DEFAULT_PORT = 443


# gRPC's own target schemes other than dns: (its naming doc), passed to gRPC as written: one server
# each here (a comma splits the address above); ipv4:/ipv6: still get the port check.
_GRPC_SCHEMES = ("ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")

# A host name as gRPC's resolver takes it (ASCII: an internationalised name goes in its xn-- form), or
# an IPv4 address; an IPv6 address goes in brackets.
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _host_port(address: str) -> tuple[str, int]:
    """The host (an IPv6 address without its brackets) and the port of "host:port", unresolved: a
    name that resolves only later (a Kubernetes Service not yet created) is still an address. Raises
    ValueError."""
    host, sep, port = address.rpartition(":")
    # str.isdigit takes '²' and '٨٠' too; at most 5 digits before int(), which refuses 4,300 in words
    # of its own
    if not sep or not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
        raise ValueError(f"address {address!r}: expected host:port, a port in 1..65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1])), int(port)
        except ValueError:
            raise ValueError(f"address {address!r}: {host} is not an IPv6 address in brackets") from None
    if not _HOST_NAME.fullmatch(host):
        raise ValueError(
            f"address {address!r}: expected host:port, the host a name or an IP address (IPv6 in "
            "brackets: [::1]:50051)"
        )
    return host, int(port)


def _ip_address(address: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    host, port = _host_port(address)
    try:
        return ipaddress.ip_address(host), port
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ValueError(f"address {address!r}: {host} does not resolve ({error.strerror})") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first: `localhost` is both
    return ipaddress.ip_address(infos[0][4][0]), port
