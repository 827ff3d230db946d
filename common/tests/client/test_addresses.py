"""What an address names: the target gRPC dials (checked first: gRPC took bad ports and hosts without a
word) and the server a client span names."""

from __future__ import annotations

import pytest

from tandem.client.addresses import channel_target, server_of


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
