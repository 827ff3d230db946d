"""--num-threads: torch's intra-op threads, at most this host's logical CPUs (config.max_num_threads).
More only take turns on the same CPUs, and far more took the host down: 100,000 starved it of processes
(SIGSEGV after the decoder listened), 2**31 failed torch.set_num_threads in a traceback. Past the bound
it is one line naming the flag and its limit, exit 2, before anything is loaded or listened on."""

from __future__ import annotations

import os

import pytest

from tandem.client.errors import ConfigError
from tandem.decoder.api.main import config_from_args
from tandem.decoder.api.main import main as decoder_main
from tandem.decoder.config import EngineConfig, max_num_threads

PREFIX = "tandem serve decoder: --num-threads (TANDEM_NUM_THREADS)"


def test_the_limit_is_this_hosts_logical_cpus() -> None:
    assert max_num_threads() == os.cpu_count()


def test_every_cpu_of_the_host_may_run_a_thread() -> None:
    assert config_from_args(["--num-threads", str(max_num_threads())]).engine.num_threads == max_num_threads()


@pytest.mark.parametrize("num_threads", [max_num_threads() + 1, 100_000, 2**31, 2**63])
def test_more_threads_than_cpus_are_one_line_naming_the_flag_and_the_limit(
    num_threads: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert decoder_main(["--num-threads", str(num_threads), "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        f"{PREFIX} must be at most {max_num_threads():,} (this host's logical CPUs: more threads only take "
        f"turns on them), got {num_threads:,}\n"
    )


def test_the_variable_is_refused_as_the_flag_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TANDEM_NUM_THREADS", str(2**31))
    assert decoder_main(["--port", "0"]) == 2
    assert capsys.readouterr().err.startswith(f"{PREFIX} must be at most {max_num_threads():,} (")


def test_the_bound_follows_the_host(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert EngineConfig(model_dir=tmp_path, num_threads=8).num_threads == 8
    with pytest.raises(ConfigError) as error:
        EngineConfig(model_dir=tmp_path, num_threads=9)
    assert error.value.field == "num_threads"
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # unknown: one thread, as os.cpu_count's users do
    assert max_num_threads() == 1
