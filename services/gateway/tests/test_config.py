"""The gateway's settings: --max-choices, --body-idle-timeout-s, --write-timeout-s, --grace-s,
--max-large-bodies-per-caller, --max-unread-answer-bytes and its share per caller reach the config from
their flags (and variables), and a bound out of range, an address or host it cannot use, is refused
naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.client.errors import ConfigError
from tandem.common import memory_limit as memory_limit_module
from tandem.common.memory_limit import MemoryLimit, memory_limit
from tandem.gateway import config
from tandem.gateway.__main__ import command, config_from_options, main
from tandem.gateway.config import MAX_BODY_BYTES, MAX_CHOICES, MIB, GatewayConfig


def _config(args: list[str]) -> GatewayConfig:
    with command().make_context("openai", args) as ctx:
        return config_from_options(ctx.params)


def test_max_choices_comes_from_its_flag_or_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _config([]).max_choices == GatewayConfig().max_choices == 16
    assert _config(["--max-choices", "4"]).max_choices == 4
    monkeypatch.setenv("TANDEM_OPENAI_MAX_CHOICES", "8")
    assert _config([]).max_choices == 8


def test_a_choices_bound_below_one_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError) as error:
        GatewayConfig(max_choices=0)
    assert error.value.field == "max_choices"


def test_the_body_idle_bound_comes_from_its_flag_and_is_refused_unless_positive() -> None:
    assert _config([]).body_idle_timeout_s == GatewayConfig().body_idle_timeout_s == 10.0
    assert _config(["--body-idle-timeout-s", "2.5"]).body_idle_timeout_s == 2.5
    with pytest.raises(ConfigError) as error:
        GatewayConfig(body_idle_timeout_s=0)
    assert error.value.field == "body_idle_timeout_s"


def test_the_write_bound_comes_from_its_flag_or_variable_and_is_refused_unless_positive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _config([]).write_timeout_s == GatewayConfig().write_timeout_s == 60.0
    assert _config(["--write-timeout-s", "5"]).write_timeout_s == 5.0
    monkeypatch.setenv("TANDEM_OPENAI_WRITE_TIMEOUT_S", "0.5")
    assert _config([]).write_timeout_s == 0.5
    with pytest.raises(ConfigError) as error:
        GatewayConfig(write_timeout_s=0)
    assert error.value.field == "write_timeout_s"


def test_the_large_bodies_of_one_caller_come_from_their_flag_or_variable_and_are_at_least_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _config([]).max_large_bodies_per_caller == GatewayConfig().max_large_bodies_per_caller == 2
    assert _config(["--max-large-bodies-per-caller", "3"]).max_large_bodies_per_caller == 3
    monkeypatch.setenv("TANDEM_OPENAI_MAX_LARGE_BODIES_PER_CALLER", "1")
    assert _config([]).max_large_bodies_per_caller == 1
    with pytest.raises(ConfigError) as error:
        GatewayConfig(max_large_bodies_per_caller=0)
    assert error.value.field == "max_large_bodies_per_caller"


def test_a_callers_share_above_all_the_large_bodies_is_refused_naming_both_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """2**63 was taken: a share no caller could ever reach, the places running out first."""
    for per_caller in ("5", str(2**63)):
        with pytest.raises(ConfigError) as error:
            _config(["--max-large-bodies", "4", "--max-large-bodies-per-caller", per_caller])
        assert error.value.field == "max_large_bodies_per_caller"
        assert error.value.reason == (
            "must be at most --max-large-bodies (4): one caller's share of the places cannot pass them "
            f"all, got {per_caller}"
        )
    assert _config(["--max-large-bodies-per-caller", "4"]).max_large_bodies_per_caller == 4  # them all
    assert main(["--max-large-bodies-per-caller", "5"]) == 2
    assert capsys.readouterr().err == (
        "tandem serve openai: --max-large-bodies-per-caller (TANDEM_OPENAI_MAX_LARGE_BODIES_PER_CALLER) "
        "must be at most --max-large-bodies (4): one caller's share of the places cannot pass them all, "
        "got 5\n"
    )


def test_the_default_share_is_lowered_to_a_small_max_large_bodies_and_only_a_share_set_is_refused() -> None:
    """The default 2 above --max-large-bodies 1 would refuse a setting that is valid alone."""
    small = _config(["--max-large-bodies", "1", "--body-workers", "1"])
    assert small.max_large_bodies_per_caller == 1
    assert GatewayConfig(max_large_bodies=1, body_workers=1).max_large_bodies_per_caller == 1
    assert GatewayConfig(max_large_bodies=16).max_large_bodies_per_caller == 2  # never raised with it
    with pytest.raises(ConfigError) as error:
        _config(["--max-large-bodies", "1", "--body-workers", "1", "--max-large-bodies-per-caller", "2"])
    assert error.value.field == "max_large_bodies_per_caller"


def test_the_grace_comes_from_its_flag_or_variable_and_is_refused_below_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`tandem up --grace-s` passes its grace to the gateway as to both services."""
    assert _config([]).grace_s == GatewayConfig().grace_s == 30.0
    assert _config(["--grace-s", "2"]).grace_s == 2.0
    monkeypatch.setenv("TANDEM_OPENAI_GRACE_S", "0")
    assert _config([]).grace_s == 0.0
    with pytest.raises(ConfigError) as error:
        GatewayConfig(grace_s=-1)
    assert error.value.field == "grace_s"


def test_the_answers_held_come_from_their_flag_or_variable_and_are_refused_out_of_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _config([]).max_unread_answer_bytes == GatewayConfig().max_unread_answer_bytes == 384 * 2**20
    assert _config(["--max-unread-answer-bytes", "10000"]).max_unread_answer_bytes == 10000
    monkeypatch.setenv("TANDEM_OPENAI_MAX_UNREAD_ANSWER_BYTES", "20000")
    assert _config([]).max_unread_answer_bytes == 20000
    # Fewer than the smallest answer's JSON, or more than a host has: a bound that bounds nothing.
    for value in (0, -1, 1023, 2**40 + 1):
        with pytest.raises(ConfigError) as error:
            GatewayConfig(max_unread_answer_bytes=value)
        assert error.value.field == "max_unread_answer_bytes" and str(value) in str(error.value)


def test_a_callers_share_of_the_answers_held_is_a_third_unless_set_and_never_over_the_whole() -> None:
    assert _config([]).unread_answer_bytes_per_caller == 128 * 2**20
    assert _config(["--max-unread-answer-bytes", "30000"]).unread_answer_bytes_per_caller == 10000
    assert _config(["--max-unread-answer-bytes", "2000"]).unread_answer_bytes_per_caller == 1024  # its least
    flags = ["--max-unread-answer-bytes-per-caller", "2000"]
    assert _config(flags).unread_answer_bytes_per_caller == 2000
    # Under the smallest answer's JSON, or over the gateway's own bound: a share that shares nothing.
    for value in (0, -1, 1023, 3001):
        with pytest.raises(ConfigError) as error:
            GatewayConfig(max_unread_answer_bytes=3000, max_unread_answer_bytes_per_caller=value)
        assert error.value.field == "max_unread_answer_bytes_per_caller" and str(value) in str(error.value)
        assert "max_unread_answer_bytes (" not in str(error.value)  # the flag named, not the field


@pytest.mark.parametrize("name", ["decoder_address", "encoder_address"])
@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1:99999",  # gRPC took it as port 34463 (mod 65536)
        "127.0.0.1:0",
        "::::",  # waited as a name
        "",  # the encoder's: a ValueError traceback at start
        "dns:///replicas:99999",
    ],
)
def test_an_address_with_a_port_past_65535_or_no_host_is_refused_naming_its_flag(
    name: str, address: str
) -> None:
    with pytest.raises(ConfigError) as error:
        _config([f"--{name.replace('_', '-')}", address])
    assert error.value.field == name and repr(address) in str(error.value)


def test_the_encoder_may_name_a_dns_server_of_its_own_but_not_a_port_past_65535() -> None:
    """Its channel resolves the name itself; the decoder's replicas are watched with the system's
    resolver, which a DNS server named in the address would not be."""
    assert GatewayConfig(encoder_address="dns://10.0.0.2/encoder:50051").encoder_address
    with pytest.raises(ConfigError) as error:
        GatewayConfig(encoder_address="dns://10.0.0.2/encoder:99999")
    assert error.value.field == "encoder_address" and "'dns://10.0.0.2/encoder:99999'" in str(error.value)
    with pytest.raises(ConfigError) as error:
        GatewayConfig(decoder_address="dns://10.0.0.2/decoder:50052")
    assert error.value.field == "decoder_address"


@pytest.mark.parametrize("host", ["", " "])
def test_an_empty_host_is_refused_not_heard_as_every_interface(host: str) -> None:
    # It listened on 0.0.0.0 and [::], on two different ports for --port 0, and logged one.
    with pytest.raises(ConfigError) as error:
        _config(["--host", host])
    assert error.value.field == "host"


def test_the_message_bound_is_the_services_own_range() -> None:
    """1 KiB as the decoder and encoder refuse below, and gRPC's C int above (2**31 was an
    OverflowError traceback as the channels opened)."""
    assert GatewayConfig(max_message_bytes=1024).max_message_bytes == 1024
    assert GatewayConfig(max_message_bytes=2**31 - 1).max_message_bytes == 2**31 - 1
    for value in (1, 1023, 2**31, 2**63):
        with pytest.raises(ConfigError) as error:
            _config(["--max-message-bytes", str(value)])
        assert error.value.field == "max_message_bytes" and f"got {value}" in str(error.value)


@pytest.mark.parametrize(
    "name",
    [
        "grace_s",
        "header_timeout_s",
        "idle_timeout_s",
        "body_idle_timeout_s",
        "body_timeout_s",
        "write_timeout_s",
    ],
)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_seconds_that_are_not_finite_are_refused_naming_the_flag(name: str, value: str) -> None:
    # NaN passed `grace_s < 0` (no grace at all), and inf every bound: it never cut anything.
    with pytest.raises(ConfigError) as error:
        _config([f"--{name.replace('_', '-')}", value])
    assert error.value.field == name and "finite" in str(error.value)


def test_max_large_bodies_of_1_alone_is_taken_the_default_workers_lowered_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It was refused naming --body-workers, a flag never given: its default 2 was above 1."""
    monkeypatch.setattr("tandem.gateway.config.available_cpus", lambda: 8)
    config = _config(["--max-large-bodies", "1"])
    assert (config.body_workers, config.max_large_bodies_per_caller) == (1, 1)
    assert _config(["--max-large-bodies", "16"]).body_workers == 2  # never raised with it
    with pytest.raises(ConfigError) as error:
        _config(["--max-large-bodies", "1", "--body-workers", "2"])  # set: refused as before
    assert error.value.field == "body_workers" and "must be in 1..1" in str(error.value)


def test_body_workers_are_no_more_than_the_large_bodies_converted_at_once_nor_the_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each is a process started with the gateway: 16 held 629 MiB, idle beyond --max-large-bodies."""
    monkeypatch.setattr("tandem.gateway.config.available_cpus", lambda: 8)
    assert _config(["--body-workers", "4"]).body_workers == 4
    for args, most in (
        (["--body-workers", "5"], 4),  # --max-large-bodies' default
        (["--body-workers", "16", "--max-large-bodies", "16"], 8),
    ):
        with pytest.raises(ConfigError) as error:
            _config(args)
        assert error.value.field == "body_workers" and f"must be in 1..{most}" in str(error.value)
    monkeypatch.setattr("tandem.gateway.config.available_cpus", lambda: 1)
    assert GatewayConfig().body_workers == 2  # the default, even on one CPU
    with pytest.raises(ConfigError):
        GatewayConfig(body_workers=3)
    with pytest.raises(ConfigError):
        GatewayConfig(body_workers=2, max_large_bodies=1)


@pytest.mark.parametrize(
    ("field", "value", "bound"),
    [
        (
            "max_body_bytes",
            MAX_BODY_BYTES + 1,
            r"at most 4294967296 \(4 GiB: room for a full gRPC message's content, 2 GiB, as base64 in JSON, "
            r"4/3 of it\)",
        ),
        ("max_body_bytes", 2**63, r"at most 4294967296 \(4 GiB"),
        ("max_choices", MAX_CHOICES + 1, r"at most 128 \(OpenAI's own bound on n"),
        ("max_choices", 2**63, r"at most 128"),
    ],
)
def test_a_bound_past_what_it_could_mean_is_refused_naming_the_limit(
    field: str, value: int, bound: str
) -> None:
    # 2**63 was taken and the gateway listened.
    with pytest.raises(ConfigError, match=bound) as error:
        GatewayConfig(**{field: value})  # type: ignore[arg-type]
    assert error.value.field == field


def test_the_bounds_themselves_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "memory_limit", lambda: MemoryLimit(2**40, None))
    assert GatewayConfig(max_body_bytes=MAX_BODY_BYTES, max_choices=MAX_CHOICES).max_choices == MAX_CHOICES


def test_large_bodies_that_would_hold_more_than_the_host_s_memory_are_refused_naming_how_many_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(config, "memory_limit", lambda: MemoryLimit(1024 * MIB, None))
    assert GatewayConfig(max_large_bodies=10, max_body_bytes=96 * MIB).max_large_bodies == 10
    with pytest.raises(
        ConfigError, match=r"must be at most 10: 11 bodies of --max-body-bytes 100663296"
    ) as error:
        GatewayConfig(max_large_bodies=11, max_body_bytes=96 * MIB)
    assert error.value.field == "max_large_bodies"
    with pytest.raises(
        ConfigError, match="more than this host's 1073741824 bytes of memory, got 9223372036854775808"
    ):
        GatewayConfig(max_large_bodies=2**63)


def test_a_containers_memory_limit_bounds_the_large_bodies_and_its_cgroup_file_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """deploy/kubernetes/openai.yaml gives the gateway 1 GiB: 4 bodies of 512 MiB (2 GiB) were taken on a
    64 GiB node, bounded by its physical memory alone, and the OOM killer ended the gateway under load."""
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("0::/\n")
    (tmp_path / "memory.max").write_text(f"{1024 * MIB}\n")
    monkeypatch.setattr(memory_limit_module, "physical_memory_bytes", lambda: 64 * 1024 * MIB)
    monkeypatch.setattr(config, "memory_limit", lambda: memory_limit(proc, tmp_path))
    assert GatewayConfig(max_large_bodies=2, max_body_bytes=512 * MIB).max_large_bodies == 2
    with pytest.raises(ConfigError) as error:
        _config(["--max-body-bytes", str(512 * MIB)])
    assert error.value.field == "max_large_bodies"
    assert error.value.reason == (
        f"must be at most 2: 4 bodies of --max-body-bytes {512 * MIB} held at once are more than the "
        f"{1024 * MIB} bytes this process may take (its cgroup's limit, {tmp_path / 'memory.max'}), got 4"
    )


def test_one_body_larger_than_the_memory_is_refused_naming_the_body_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It named --max-large-bodies, already at its floor: 'must be at most 1: 1 bodies ... got 1'."""
    monkeypatch.setattr(config, "memory_limit", lambda: MemoryLimit(2048 * MIB, None))
    with pytest.raises(ConfigError) as error:
        GatewayConfig(max_large_bodies=1, body_workers=1, max_body_bytes=4096 * MIB)
    assert error.value.field == "max_body_bytes"
    assert error.value.reason == (
        f"must be at most {2048 * MIB}: one body of it is more than this host's {2048 * MIB} bytes of "
        f"memory, got {4096 * MIB}"
    )


def test_the_flags_past_their_bounds_are_refused_from_the_command_line() -> None:
    with pytest.raises(ConfigError) as error:
        _config(["--max-large-bodies", str(2**63)])
    assert error.value.field == "max_large_bodies"


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("max_body_bytes", 0, "must be >= 1, got 0"),
        ("max_streams_per_caller", 0, "must be >= 1, got 0"),
        ("max_choices", 0, "must be >= 1, got 0"),
        ("max_embeddings_bytes", 0, "must be >= 1, got 0"),
        ("large_body_bytes", 0, "must be >= 1, got 0"),
        ("max_large_bodies", 0, "must be >= 1, got 0"),
        ("max_large_bodies_per_caller", 0, "must be >= 1, got 0"),
        ("max_connections", 0, "must be >= 1, got 0"),
        ("max_idle_channels", -1, "must be >= 0, got -1"),
        ("port", -1, "must be in 0..65535, got -1"),
        ("port", 65536, "must be in 0..65535, got 65536"),
        ("grace_s", -0.5, "must be a finite number of seconds, 0 or more, got -0.5"),
        ("header_timeout_s", 0, "must be a finite number of seconds, more than 0, got 0"),
        ("idle_timeout_s", 0, "must be a finite number of seconds, more than 0, got 0"),
        ("body_idle_timeout_s", 0, "must be a finite number of seconds, more than 0, got 0"),
        ("body_timeout_s", -1, "must be a finite number of seconds, more than 0, got -1"),
        ("write_timeout_s", 0, "must be a finite number of seconds, more than 0, got 0"),
        ("host", "", "must name an address (0.0.0.0: every IPv4 one), got ''"),
    ],
)
def test_a_bound_below_its_least_is_refused_naming_the_field_and_the_least(
    field: str, value: object, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config, "memory_limit", lambda: MemoryLimit(2**40, None))  # not this host's
    with pytest.raises(ConfigError) as error:
        GatewayConfig(**{field: value})  # type: ignore[arg-type]
    assert (error.value.field, error.value.reason) == (field, reason)


def test_each_bound_at_its_least_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "memory_limit", lambda: MemoryLimit(2**40, None))
    least = {
        "max_body_bytes": 1,
        "max_streams_per_caller": 1,
        "max_choices": 1,
        "max_embeddings_bytes": 1,
        "large_body_bytes": 1,
        "max_large_bodies": 1,
        "max_large_bodies_per_caller": 1,
        "max_connections": 1,
        "max_idle_channels": 0,
        "port": 0,
        "grace_s": 0.0,
    }
    taken = GatewayConfig(**least)  # type: ignore[arg-type]
    assert {field: getattr(taken, field) for field in least} == least
    assert GatewayConfig(port=65535).port == 65535
