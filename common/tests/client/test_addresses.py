"""What an address names: the target gRPC dials (checked first: gRPC took bad ports and hosts without a
word) and the server a client span names."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.client.addresses import DnsName, channel_target, dns_name, server_of


@pytest.mark.parametrize("port", ["\u0668\u0660", "\u00b2", "0", "70000", "9" * 5000])
def test_a_port_of_digits_outside_ascii_is_not_a_port(port: str) -> None:
    """'٨٠' was taken as port 80, '²' and 5,000 digits failed in int() with its own words, 0 and
    70000 were taken."""
    with pytest.raises(ValueError, match="expected host:port"):
        channel_target(f"127.0.0.1:1,127.0.0.1:{port}")


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1:116328", "127.0.0.1:0", "127.0.0.1", "::::", "::1:50051", "[nope]:1", "http://x:80"],
)
def test_a_single_address_is_checked_as_a_list_s_are(address: str) -> None:
    """One address went to gRPC unchecked: port 116328 reached the server on 50792 (mod 65536), and
    "::::" waited out its deadline as a name that does not resolve."""
    with pytest.raises(ValueError, match=r"address .*: (expected host:port|\[nope\] is not)"):
        channel_target(address)


@pytest.mark.parametrize(
    "address", ["ipv4:127.0.0.1:50051", "ipv6:[::1]:50051", "unix:/run/tandem.sock", "unix-abstract:tandem"]
)
def test_grpcs_own_target_schemes_pass_as_written(address: str) -> None:
    """gRPC's naming schemes reached the server before single addresses were checked, and still do."""
    assert channel_target(address) == (address, False)


def test_an_ipv4_target_still_has_its_port_checked() -> None:
    with pytest.raises(ValueError, match="a port in 1..65535"):
        channel_target("ipv4:127.0.0.1:116328")


@pytest.mark.parametrize("address", ["decoder:50052", "127.0.0.1:1", "[::1]:65535", "no.such.invalid:1"])
def test_a_single_address_is_not_resolved(address: str) -> None:
    """A name that resolves only later (a Service not created yet) is still an address."""
    assert channel_target(address) == (address, False)


@pytest.mark.parametrize(
    ("address", "server"),
    [
        ("decoder:50052", ("decoder", 50052)),
        ("[::1]:50052", ("::1", 50052)),
        ("ipv4:10.0.0.7:50052", ("10.0.0.7", 50052)),
        ("dns:///decoder.tandem.svc:50052", ("decoder.tandem.svc", 50052)),
        ("dns://10.0.0.2/decoder:50052", ("decoder", 50052)),
        ("unix:/run/tandem.sock", ("/run/tandem.sock", None)),
        ("unix:///run/tandem.sock", ("/run/tandem.sock", None)),  # an empty authority: was '///run/...'
        ("ipv6:[fe80::1%25eth0]:50052", ("fe80::1%eth0", 50052)),  # the URI's %25 is the zone's %
        ("dns:///decoder.tandem.svc", ("decoder.tandem.svc", 443)),  # gRPC's port for it: was None
        ("dns:[::1]", ("::1", 443)),
        ("a:1,b:2", None),  # several: no one of them is the call's server
        (["a:1", "b:2"], None),
    ],
)
def test_the_server_an_address_names_is_a_single_servers_or_a_dns_names(address, server) -> None:
    assert server_of(address) == server


@pytest.mark.parametrize(
    ("address", "name"),
    [
        ("dns:///decoder.tandem.svc:50052", DnsName("decoder.tandem.svc", 50052, "")),
        ("dns:decoder:50052", DnsName("decoder", 50052, "")),
        ("dns:/decoder:50052", DnsName("decoder", 50052, "")),
        ("dns://10.0.0.2/decoder:50052", DnsName("decoder", 50052, "10.0.0.2")),
        ("dns:///decoder", DnsName("decoder", 443, "")),  # gRPC's port for a name without one
        ("dns:///[::1]:5", DnsName("[::1]", 5, "")),
        ("dns:///::1", DnsName("[::1]", 443, "")),  # IPv6 without brackets: no port
        ("decoder:50052", None),
        ("unix:/run/tandem.sock", None),
    ],
)
def test_a_dns_target_is_read_in_every_form_grpc_reads(address: str, name: DnsName | None) -> None:
    assert dns_name(address) == name


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("dns:///decoder:70000", "port '70000' is not a port"),
        ("dns:///decoder:0", "port '0' is not a port"),
        ("dns:///decoder:\u0668\u0660", "is not a port"),
        ("dns:///decoder:" + "9" * 5000, "is not a port"),
        ("dns:///decoder:", "port '' is not a port"),  # a colon and no port: a port left out
        ("dns:[::1]:", "port '' is not a port"),
        ("dns:///:50052", "names no host"),
        ("dns://decoder:50052", "names no host"),  # the name as the DNS server's, and no name
        ("dns:///[::1", "names no host"),
        ("dns:///[nope]:1", r"\[nope\] is not an IPv6 address"),
        ("dns:///decoder host:1", "'decoder host' is not a host name"),
        ("dns:////decoder:1", "'/decoder' is not a host name"),  # gRPC drops one '/' of the path
    ],
)
def test_a_dns_target_grpc_cannot_resolve_is_refused_by_the_channel_too(address: str, why: str) -> None:
    """channel_target passed every dns: target to gRPC unread, where the gateway's reading refused a
    port past 65535 (gRPC wraps it, mod 65536) and server_of named no server for it: one reading now."""
    with pytest.raises(ValueError, match=why):
        dns_name(address)
    with pytest.raises(ValueError, match=why):
        channel_target(address)
    assert server_of(address) is None


@pytest.mark.parametrize(
    ("address", "server"),
    [("dns:/decoder:50052", ("decoder", 50052)), ("dns:///::1", ("::1", 443))],
)
def test_a_span_names_the_server_of_each_dns_form_the_gateway_watches(address: str, server) -> None:
    """gRPC reads both (a path's one leading '/' dropped; an IPv6 address without brackets has no
    port); the gateway watched them, while server_of named no server for either."""
    assert server_of(address) == server
    assert channel_target(address) == (address, True)


@given(st.text(alphabet="dns:/[]0123456789abcf.-_", max_size=24).map("dns:".__add__))
def test_every_dns_target_a_channel_takes_is_a_name_and_a_port(address: str) -> None:
    """channel._servers kept a fallback (no servers to wait for) for a dns: target whose name or port
    server_of could not read; none reaches it: channel_target takes a dns: target only as dns_name reads
    it, whose port is always written or 443."""
    try:
        target, is_balanced = channel_target(address)
    except ValueError:
        return
    name = dns_name(target)
    assert name is not None and is_balanced
    server = server_of(address)
    assert server is not None and server[1] == name.port
