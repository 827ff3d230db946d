"""The replicas an address names (`replica_addresses.py`): a list, resolved once, or a `dns:` name,
read as gRPC reads it and looked up again as replicas come and go, one address family at a time."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.client.addresses import channel_target, dns_name
from tandem.gateway.replica_addresses import name_of, names_one_server, resolve_name, static_replicas


def test_replicas_are_a_list_resolved_once_or_a_name_resolved_as_it_goes() -> None:
    assert static_replicas("127.0.0.1:1,localhost:2") == ("127.0.0.1:1", "127.0.0.1:2")
    assert static_replicas(["[::1]:1", "[::1]:2"]) == ("[::1]:1", "[::1]:2")  # type: ignore[arg-type]
    assert static_replicas("dns:///decoder.tandem.svc:50052") is None
    assert static_replicas("dns:decoder:50052") is None
    assert name_of("decoder:50052") is None


def test_a_dns_name_is_read_in_every_form_grpc_reads() -> None:
    assert name_of("dns:///decoder.tandem.svc:50052") == "decoder.tandem.svc:50052"
    assert name_of("dns:decoder:50052") == "decoder:50052"
    assert name_of("dns:/decoder:50052") == "decoder:50052"
    assert name_of("dns:///[::1]:5") == "[::1]:5"
    # No port: gRPC's, 443.
    assert name_of("dns:///decoder") == name_of("dns:decoder") == "decoder:443"
    assert name_of("dns:///[::1]") == name_of("dns:///::1") == "[::1]:443"


# What may follow "dns:" (or stand alone): any characters of a target, or a path and a server's parts.
_TARGET_REST = st.one_of(
    st.text(alphabet="dns:/[]0123456789abcf.-_", max_size=24),
    st.tuples(
        st.sampled_from(["", "/", "///", "//10.0.0.2/"]),
        st.sampled_from(["decoder", "127.0.0.1", "[::1]", "::1"]),
        st.sampled_from(["", ":1", ":50052", ":70000"]),
    ).map("".join),
)


@given(
    st.tuples(
        st.sampled_from(["", " ", "\t"]),
        st.sampled_from(["dns:", "DNS:", ""]),
        _TARGET_REST,
        st.sampled_from(["", " "]),
    ).map("".join)
)
def test_every_address_a_channel_takes_is_read_alike_by_the_gateway(address: str) -> None:
    """One reading of an address, `channel_target`'s: its dns: name is the one the gateway watches
    (`name_of`, `static_replicas`), and whether it names several servers decides its channel
    (`names_one_server`: a prefix test read " dns:///x:1" as one server, while name_of read no name)."""
    try:
        target, is_balanced = channel_target(address)
    except ValueError:
        return
    name = dns_name(target)
    assert names_one_server(address) is not is_balanced
    if name is None:
        assert name_of(address) is None and static_replicas(address) == (target,)
    elif name.resolver:  # a DNS server of its own: the gateway's resolver is not it
        with pytest.raises(ValueError, match="names a DNS server"):
            name_of(address)
    else:
        assert name_of(address) == name.host_port and static_replicas(address) is None


async def test_a_name_resolves_to_its_ipv4_servers_where_it_has_any_else_its_ipv6_ones() -> None:
    """Each caller's channel is opened over a static list of one family (`ipv4:` or `ipv6:`)."""
    assert await resolve_name("localhost:7") == ("127.0.0.1:7",)  # IPv4 first, where ::1 is named too
    assert await resolve_name("[::1]:7") == ("[::1]:7",)
    with pytest.raises(OSError):
        await resolve_name("nohost.invalid:7")
