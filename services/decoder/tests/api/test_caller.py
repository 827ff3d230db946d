"""caller_of: a connection without tokens, a token's digest with them (never the token itself)."""

from __future__ import annotations

from tandem.decoder.api.caller import caller_of


def test_without_tokens_a_caller_is_its_connection_whatever_it_sends() -> None:
    metadata = [("authorization", "Bearer made-up")]
    assert caller_of("ipv4:127.0.0.1:5000", metadata, identify_by_token=False) == "peer:ipv4:127.0.0.1:5000"
    assert caller_of("ipv4:127.0.0.1:5001", None, identify_by_token=False) == "peer:ipv4:127.0.0.1:5001"


def test_with_tokens_every_connection_of_one_token_is_one_caller_and_the_token_is_not_kept() -> None:
    a1 = caller_of("ipv4:127.0.0.1:5000", [("authorization", "Bearer secret-a")], identify_by_token=True)
    a2 = caller_of("ipv4:10.0.0.9:7000", [("authorization", b"bearer  secret-a ")], identify_by_token=True)
    b = caller_of("ipv4:127.0.0.1:5000", [("authorization", "Bearer secret-b")], identify_by_token=True)
    assert a1 == a2 != b
    assert a1.startswith("token:") and "secret" not in a1
