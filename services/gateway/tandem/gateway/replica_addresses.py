"""The replicas an address names: a list of addresses, found once, or a `dns:` name, looked up again as
replicas come and go (`Replicas`). Each replica is one "ip:port" the gateway watches over a channel of
its own."""

from __future__ import annotations

import asyncio
import socket

from tandem.client.addresses import dns_name
from tandem.client.channel import channel_target


def static_replicas(address: str) -> tuple[str, ...] | None:
    """The replicas of a list of addresses, each "ip:port" (host names resolved once, as the clients
    do); None for a `dns:` name (`name_of`). Raises ValueError for an address it cannot use."""
    target, _ = channel_target(address)
    if dns_name(target) is not None:
        return None
    scheme, _, servers = target.partition(":")
    return tuple(servers.split(",")) if scheme in ("ipv4", "ipv6") else (target,)


def name_of(address: str) -> str | None:
    """The "host:port" a `dns:` address names, read as gRPC reads it (`dns_name`): `dns:host:port`,
    `dns:///host:port`, the port 443 where none is written; None for another address. Raises
    ValueError for `dns://server/host:port`, which names a DNS server to ask: the gateway looks
    replicas up with the system's resolver, and would watch other replicas than the name's."""
    address = address.strip()  # as `channel_target` reads one address: " dns:///x:1" is a name
    name = dns_name(address)
    if name is None:
        return None
    if name.resolver:
        raise ValueError(
            f"address {address!r}: names a DNS server ({name.resolver}); the gateway resolves names "
            f"with the system's resolver: write dns:///{address.removeprefix('dns://').partition('/')[2]}"
        )
    return name.host_port


def names_one_server(address: str) -> bool:
    """Whether `address` (configured, or one of `Replicas.targets`) is one server, which a channel
    reaches with the replicas' keepalive, rather than several, balanced: a list, or a `dns:` name in any
    form `channel_target` reads (the reading every other part of the gateway uses). Raises ValueError
    for an address it cannot use."""
    return not channel_target(address)[1]


async def resolve_name(name: str) -> tuple[str, ...]:
    """Every server `name` ("host:port") resolves to, as "ip:port": IPv4 where it has any, else IPv6.
    One family because each caller's channel is opened over a static list, `ipv4:` or `ipv6:`
    (`channel_target`), which holds one; gRPC's own dns resolver would balance over both.
    Raises OSError when it does not resolve."""
    host, _, port = name.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    found = {info[0]: [] for info in infos}
    for family, *_, sockaddr in infos:
        ip = sockaddr[0]
        server = f"{ip}:{port}" if family == socket.AF_INET else f"[{ip}]:{port}"
        if server not in found[family]:
            found[family].append(server)
    return tuple(found.get(socket.AF_INET) or found.get(socket.AF_INET6) or ())
