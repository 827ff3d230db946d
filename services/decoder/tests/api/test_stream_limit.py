"""At most N open Generate streams per connection; other connections are not affected."""

import pytest

from tandem.client.errors import ErrorInfo, ResourceExhausted
from tandem.decoder.api.main import config_from_args
from tandem.decoder.api.stream_limit import StreamLimit


def test_a_connection_at_its_bound_is_refused_and_others_are_not() -> None:
    limit = StreamLimit(2)
    with limit.open("ipv4:127.0.0.1:1000"), limit.open("ipv4:127.0.0.1:1000"):
        with pytest.raises(ResourceExhausted, match="already has 2 Generate streams open") as caught:
            with limit.open("ipv4:127.0.0.1:1000"):
                pass
        assert caught.value.retry_after_s > 0
        with limit.open("ipv4:127.0.0.1:1001"):  # another connection
            assert limit.num_open("ipv4:127.0.0.1:1001") == 1
    assert limit.num_open("ipv4:127.0.0.1:1000") == 0


def test_a_stream_that_fails_still_gives_its_place_back() -> None:
    limit = StreamLimit(1)
    with pytest.raises(RuntimeError), limit.open("peer"):
        raise RuntimeError("the stream failed")
    with limit.open("peer"):
        pass


def test_no_bound_counts_but_never_refuses() -> None:
    limit = StreamLimit(None)
    with limit.open("peer"), limit.open("peer"), limit.open("peer"):
        assert limit.num_open("peer") == 3


def test_the_bound_comes_from_the_flag_or_the_environment_and_defaults_to_32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert config_from_args(["--model", "m"]).max_streams_per_connection == 32
    assert (
        config_from_args(["--model", "m", "--max-streams-per-connection", "4"]).max_streams_per_connection
        == 4
    )
    monkeypatch.setenv("TANDEM_MAX_STREAMS_PER_CONNECTION", "7")
    assert config_from_args(["--model", "m"]).max_streams_per_connection == 7
    with pytest.raises(ValueError, match="must be >= 1"):
        config_from_args(["--model", "m", "--max-streams-per-connection", "0"])


def test_a_token_bound_says_whose_streams_and_which_flag() -> None:
    limit = StreamLimit(1, "bearer token", "--max-streams-per-token")
    with limit.open("token:ab"), pytest.raises(ResourceExhausted) as caught, limit.open("token:ab"):
        pass
    assert "this bearer token already has 1 Generate streams open (--max-streams-per-token); end one" == str(
        caught.value
    )
    assert caught.value.info == ErrorInfo(
        "STREAM_LIMIT",
        "tandem.decoder",
        {"holder": "bearer token", "maxStreams": "1", "flag": "--max-streams-per-token"},
    )


def test_the_token_bound_comes_from_the_flag_or_the_environment_and_defaults_to_256(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert config_from_args(["--model", "m"]).max_streams_per_token == 256
    assert config_from_args(["--model", "m", "--max-streams-per-token", "4"]).max_streams_per_token == 4
    monkeypatch.setenv("TANDEM_MAX_STREAMS_PER_TOKEN", "7")
    assert config_from_args(["--model", "m"]).max_streams_per_token == 7
    with pytest.raises(ValueError, match="max_streams_per_token.*must be >= 1"):
        config_from_args(["--model", "m", "--max-streams-per-token", "0"])
