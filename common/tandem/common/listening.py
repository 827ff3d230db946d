"""Where a server listens: the addresses a --host names, one port at each, and the refusals.

gRPC, given "host:port", listens on every address it resolves the name to where it can and only
logs the others ("Only 1 addresses added out of total 2 resolved"): a server on "localhost" (::1 and
127.0.0.1) whose port another process held on 127.0.0.1 listened on ::1 alone, and its callers of
127.0.0.1 reached the other process. With port 0 the kernel picks a port free on the first address
only, so a CI start did exactly that. Here a name's addresses are bound one gRPC call each (a call
that fails raises), on one port: for port 0 a port free at each, and where another process takes it
at one of them between that check and the bind, the server is built again on another (`start_server`).
An address or a wildcard keeps gRPC's own handling, which binds one socket.

The refusals are one line naming the flag: `port` for a port in use or one that needs privileges,
`host` for a name that does not resolve or an address this machine lacks. Probes bind the way gRPC
does: SO_REUSEADDR, no SO_REUSEPORT.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from dataclasses import dataclass

from tandem.client.errors import ConfigError

Address = tuple[socket.AddressFamily, str]  # (family, address without port)

LOOPBACKS: tuple[Address, ...] = ((socket.AF_INET6, "::1"), (socket.AF_INET, "127.0.0.1"))
PORT_TRIES = 64  # kernel picks tried for a port free at each address (one in thousands is not)


@dataclass(frozen=True)
class Listen:
    """How a server binds `host`: `addresses` one gRPC call each on one port (a name), or `host` as
    given in one call (an address or a wildcard: gRPC binds one socket, "0.0.0.0" a dual-stack "::"
    where it can)."""

    host: str
    addresses: tuple[Address, ...]  # what the probes bind; a name's are also what gRPC is given
    one_call: bool  # bind "host:port" as it is, not each address
    v6only: bool = False  # the IPv6 sockets hold IPv6 alone (asyncio's); gRPC's "::" is dual-stack

    def targets(self, port: int) -> list[str]:
        """The "host:port" strings to give gRPC, one call each."""
        if self.one_call:
            return [f"{listen_host(self.host)}:{port}"]
        return [f"{listen_host(address)}:{port}" for _, address in self.addresses]


def listen_host(host: str) -> str:
    """`host` as gRPC's "host:port" takes it: an IPv6 address in brackets ("::" read as "::50052",
    no address at all)."""
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        return host
    return f"[{host}]" if is_v6 else host


def is_localhost(host: str) -> bool:
    """Whether gRPC's resolver answers `host` with the loopbacks without asking: "localhost" in any
    case, with a trailing dot, and any name under .localhost (RFC 6761)."""
    name = host.lower().rstrip(".")
    return name == "localhost" or name.endswith(".localhost")


def listen_plan(host: str) -> Listen:
    """The addresses gRPC listens on for `host` that this machine has. Raises ConfigError("host")
    where the name does not resolve or none of its addresses, or the address given, exists here."""
    literal = _literal(host)
    if literal is not None:
        if literal == (socket.AF_INET, "0.0.0.0") and _bindable((socket.AF_INET6, "::")):
            # gRPC binds "0.0.0.0" as a dual-stack "::": a port held on ::1 alone makes it fall back.
            return Listen(host, ((socket.AF_INET6, "::"),), one_call=True)
        _require_bindable(host, literal)
        return Listen(host, (literal,), one_call=True)
    named = list(LOOPBACKS) if is_localhost(host) else _resolved(host)
    return Listen(host, _here(host, _uncovered(named)), one_call=False)


def asyncio_plan(host: str) -> Listen:
    """The addresses asyncio's create_server listens on for `host` (the gateway's): what getaddrinfo
    answers, nothing added for localhost, each IPv6 socket IPv6 alone ("0.0.0.0" is IPv4, "::" IPv6)."""
    literal = _literal(host)
    if literal is not None:
        if literal[1] not in ("0.0.0.0", "::"):
            _require_bindable(host, literal)
        return Listen(host, (literal,), one_call=True, v6only=True)
    return Listen(host, _here(host, list(dict.fromkeys(_resolved(host)))), one_call=False, v6only=True)


def _literal(host: str) -> Address | None:
    """`host` as an address (an IPv4-mapped IPv6 one as the IPv4 it is), or None for a name."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return _address(ip)


def _address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> Address:
    if ip.version == 6 and ip.ipv4_mapped is not None:  # ::ffff:127.0.0.1 is 127.0.0.1's socket
        return (socket.AF_INET, str(ip.ipv4_mapped))
    return (socket.AF_INET6 if ip.version == 6 else socket.AF_INET, str(ip))


def _resolved(host: str) -> list[Address]:
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ConfigError("host", f"{host!r} does not resolve: {error.strerror}") from None
    return [_address(ipaddress.ip_address(str(address[0]).split("%")[0])) for _, _, _, _, address in infos]


def _uncovered(named: list[Address]) -> list[Address]:
    """`named` without the addresses a wildcard among them already holds (gRPC's "::" holds both
    families): the name's sockets would otherwise collide with each other, said of another process."""
    named = list(dict.fromkeys(named))
    if (socket.AF_INET6, "::") in named:
        return [(socket.AF_INET6, "::")]
    if (socket.AF_INET, "0.0.0.0") in named:
        return [a for a in named if a[0] != socket.AF_INET or a[1] == "0.0.0.0"]
    return named


def _here(host: str, named: list[Address]) -> tuple[Address, ...]:
    here = tuple(address for address in named if _bindable(address))
    if not here:
        shown = ", ".join(address for _, address in named)
        raise ConfigError(
            "host", f"cannot listen on {host}: this machine has none of its addresses ({shown})"
        )
    return here


def _require_bindable(host: str, address: Address) -> None:
    """An address given as --host that this machine lacks (::1 without IPv6) is refused before any
    bind: with port 0 gRPC's own error came after the model had loaded."""
    try:
        _probe(*address, 0).close()
    except OSError as error:
        if error.errno != errno.EACCES:
            raise ConfigError("host", f"cannot listen on {listen_host(host)}: {error.strerror}") from None


def check_port_free(host: str, port: int, plan: Listen | None = None) -> None:
    """Raises ConfigError("port") when another process listens on `port` at any address gRPC binds for
    `host` (or `plan`'s, asyncio_plan for the gateway) or the port needs privileges there,
    ConfigError("host") when `host` does not resolve or none of its addresses exists here. Port 0 is
    always free."""
    plan = plan or listen_plan(host)
    if port == 0:
        return
    probes = _probe_all(plan, port)
    for probe in probes:
        probe.close()


def free_port(host: str, tries: int = PORT_TRIES) -> int:
    """A port no process listens on at any address gRPC binds for `host`, for a server asked for port
    0; 0 where `host` is one socket (the kernel's pick is free there, with no window between this
    check and the bind)."""
    return free_port_of(listen_plan(host), tries)


def free_port_of(plan: Listen, tries: int = PORT_TRIES) -> int:
    if len(plan.addresses) <= 1:
        return 0
    for _ in range(tries):
        first = _kernel_pick(plan.addresses[0], plan.v6only)
        port = first.getsockname()[1]
        try:
            probes = _probe_all(Listen(plan.host, plan.addresses[1:], plan.one_call, plan.v6only), port)
        except ConfigError as error:
            if error.field == "port":
                continue  # held at another address: the next pick
            raise
        finally:
            first.close()
        for probe in probes:
            probe.close()
        return port
    raise ConfigError(
        "port", f"0: no port free at every address of {plan.host} in {tries} of the kernel's picks"
    )


def in_use_at(plan: Listen, address: Address, port: int) -> ConfigError | None:
    """After gRPC refused `address` of `plan` on `port`: the refusal naming the port where another
    process holds it there (taken since the check), else None (the address is the cause)."""
    try:
        _probe(*address, port).close()
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            return _refusal(plan, address, port, error)
    return None


def _probe(family: socket.AddressFamily, address: str, port: int, v6only: bool = False) -> socket.socket:
    """A socket bound to address:port the way gRPC binds (asyncio, with `v6only`). Raises OSError."""
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        probe.bind((address, port))
    except OSError:
        probe.close()
        raise
    return probe


def _kernel_pick(address: Address, v6only: bool = False) -> socket.socket:
    """A socket bound to the address on the port the kernel picks (free there, not necessarily elsewhere)."""
    return _probe(*address, 0, v6only)


def _bindable(address: Address) -> bool:
    """Whether this machine can listen on the address at all (::1 without IPv6 cannot; gRPC leaves it
    out of a name's addresses)."""
    try:
        _probe(*address, 0).close()
    except OSError:
        return False
    return True


def _probe_all(plan: Listen, port: int) -> list[socket.socket]:
    """Sockets bound to each of `plan`'s addresses on `port`, held together (the caller closes them).
    Raises `_refusal`'s ConfigError at the first address that refuses."""
    probes: list[socket.socket] = []
    try:
        for address in plan.addresses:
            try:
                probes.append(_probe(*address, port, plan.v6only))
            except OSError as error:
                raise _refusal(plan, address, port, error) from None
    except ConfigError:
        for probe in probes:
            probe.close()
        raise
    return probes


def _refusal(plan: Listen, address: Address, port: int, error: OSError) -> ConfigError:
    """One line naming the flag at fault: the port where another process listens there or it needs
    privileges, else the host; the address where the host has several."""
    host = listen_host(plan.host)
    where = "" if len(plan.addresses) == 1 else f" ({address[1]})"
    if error.errno == errno.EADDRINUSE:
        return ConfigError("port", f"{port} is in use on {host}{where}: another process listens there")
    if error.errno == errno.EACCES:
        return ConfigError("port", f"{port} needs privileges on {host}{where}: {error.strerror}")
    return ConfigError("host", f"cannot listen on {host}:{port}{where}: {error.strerror}")
