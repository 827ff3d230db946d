"""A server names itself by its listen address, or by this host's name where it listens on every
interface; a caller balancing over several names the list's entry that answered (its own name, or the
only entry on its port), else the server's own name with the list it is one of; and the address as
configured where no server said, or where it names one server."""

from __future__ import annotations

import socket

import pytest

from tandem.common.replica_name import HEADER, MAX_NAME_CHARS, answering, own_name, reported


def test_a_server_names_itself_by_its_listen_address_or_this_hosts_name_where_it_listens_on_all() -> None:
    assert own_name("127.0.0.1", 50052) == "127.0.0.1:50052"
    assert own_name("::1", 50052) == "[::1]:50052"
    assert own_name("encoder.internal", 50052) == "encoder.internal:50052"
    assert own_name("0.0.0.0", 50052) == f"{socket.gethostname()}:50052"
    assert own_name("::", 50052) == f"{socket.gethostname()}:50052"


def test_the_name_is_read_from_the_initial_metadata_and_none_where_it_is_not_there() -> None:
    assert reported([("content-type", "application/grpc"), (HEADER, "127.0.0.1:1")]) == "127.0.0.1:1"
    assert reported([(HEADER, b"127.0.0.1:1")]) == "127.0.0.1:1"
    assert reported([("content-type", "application/grpc")]) is None
    assert reported(None) is None


def test_a_reported_name_is_cut_and_held_to_printable_ascii_before_it_reaches_an_error() -> None:
    """Whatever answers on a configured address names itself: a 7,000-character name came back whole
    in the caller's error text."""
    assert reported([(HEADER, "h" * 7_000)]) == "h" * MAX_NAME_CHARS
    assert reported([(HEADER, "a\u202eb\tc:1")]) == "a?b?c:1"
    assert reported([(HEADER, b"\xff:1")]) == "?:1"
    assert reported([(HEADER, "")]) is None


@pytest.mark.parametrize(
    ("address", "name", "named"),
    [
        ("127.0.0.1:1,127.0.0.1:2", "127.0.0.1:2", "127.0.0.1:2"),  # an entry of the list
        ("localhost:1,localhost:2", "127.0.0.1:2", "localhost:2"),  # the only entry on its port
        ("a:50052,b:50052", "pod-7:50052", "pod-7:50052 (of a:50052,b:50052)"),  # several on its port
        ("dns:///encoder:50052", "pod-7:50052", "pod-7:50052 (of dns:///encoder:50052)"),
        ("dns:encoder", "pod-7:443", "pod-7:443 (of dns:encoder)"),  # a name, in each form gRPC reads
        ("dns://10.0.0.2/encoder:50052", "pod-7:50052", "pod-7:50052 (of dns://10.0.0.2/encoder:50052)"),
        ("dns:///encoder:99999", "pod-7:1", "pod-7:1 (of dns:///encoder:99999)"),  # refused at start
        ("127.0.0.1:1,127.0.0.1:2", None, "127.0.0.1:1,127.0.0.1:2"),  # no server said: every one
        ("localhost:1", "127.0.0.1:1", "localhost:1"),  # one server: as the caller names it
    ],
)
def test_a_caller_names_the_replica_that_answered(address: str, name: str | None, named: str) -> None:
    assert answering(address, name) == named
