"""What `serve` releases however it ends once the model loaded: the engine (its thread, which the
interpreter's exit joins), the encoder parts, the server's port and the telemetry, each once. Only an
--encoder of another model released them: a checkpoint file gone after the load, an EncoderParts or a
check that raised, a start-up heap or health that failed, left the engine's thread running, the port
bound and the spans unflushed; a drain or an engine shutdown that raised left the encoder parts and
the telemetry. The tiny model is served in this process, its engine built from the session's load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.tests.ports import free_port
from tandem.client.telemetry import Telemetry
from tandem.decoder.api import main as decoder_main
from tandem.decoder.api import serving
from tandem.decoder.api.encoder_parts import EncoderParts
from tandem.decoder.config import DecoderConfig, EngineConfig
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.models.loader import LoadedModel


@dataclasses.dataclass
class Held:
    """What one `serve` holds, counted as it is released."""

    config: DecoderConfig
    stop: asyncio.Event  # the signal's event (stop_on_signals')
    engines: list[Engine] = dataclasses.field(default_factory=list)  # the engine the load built, if any
    released: list[str] = dataclasses.field(default_factory=list)  # each release, in order
    threads: set[threading.Thread] = dataclasses.field(default_factory=set)  # alive before it started

    def assert_all_released(self, is_loaded: bool = True) -> None:
        """Each release taken once (the engine's where it loaded), the port closed, and no thread of
        its left to hold the interpreter's exit."""
        assert self.released.count("engine.shutdown") == int(is_loaded), self.released
        assert self.released.count("telemetry.shutdown") == 1, self.released
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", self.config.server.port), timeout=5).close()
        left = [t for t in threading.enumerate() if t not in self.threads and not t.daemon]
        for thread in left:  # the loader's worker ends once idle, at its own pace
            thread.join(10)
        assert [t.name for t in left if t.is_alive()] == []
        assert gc.get_freeze_count() == 0  # the start-up heap, frozen just before SERVING, thawed


def counting(released: list[str], name: str, release: Callable[[], object]) -> Callable[[], object]:
    def counted() -> object:
        released.append(name)
        return release()

    return counted


@pytest.fixture
def held(tiny_model_dir: Path, tiny_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> Iterator[Held]:
    """A decoder config on a free port whose load builds the tiny engine (from the session's weights),
    telemetry off, and signals replaced by `stop`; each release counted."""
    args = ["--model", str(tiny_model_dir), "--port", str(free_port()), "--dtype", "float32"]
    config = decoder_main.config_from_args([*args, "--grace-s", "0"])
    held = Held(config, asyncio.Event(), threads=set(threading.enumerate()))

    def load(config: DecoderConfig, _: object) -> Engine:
        engine = Engine(
            EngineConfig(model_dir=config.engine.model_dir, dtype="float32", num_kv_blocks=64, block_size=4),
            tiny_fp32,
        ).start()
        counted = counting(held.released, "engine.shutdown", engine.shutdown)
        engine.shutdown = counted  # type: ignore[method-assign]
        held.engines.append(engine)
        return engine

    def telemetry(*_: object) -> Telemetry:
        off = Telemetry("tandem-decoder", None, None)
        counted = counting(held.released, "telemetry.shutdown", off.shutdown)
        off.shutdown = counted  # type: ignore[method-assign]
        return off

    close = EncoderParts.close

    async def close_counted(self: EncoderParts) -> None:
        held.released.append("encoder_parts.close")
        await close(self)

    monkeypatch.setattr(serving, "_load_engine", load)
    monkeypatch.setattr(serving, "setup_telemetry", telemetry)
    monkeypatch.setattr(serving, "stop_on_signals", lambda *_: held.stop)
    monkeypatch.setattr(EncoderParts, "close", close_counted)
    yield held
    if held.engines and "engine.shutdown" not in held.released:  # left running by a failing test
        held.engines[0].shutdown()


def with_encoder(held: Held) -> None:
    """An --encoder where nothing listens: the check of its model would wait ENCODER_CHECK_S."""
    held.config = dataclasses.replace(held.config, encoder_address=f"127.0.0.1:{free_port()}")


def raising(error: BaseException) -> Callable[..., object]:
    def raise_it(*_: object, **__: object) -> object:
        raise error

    return raise_it


async def test_a_checkpoint_file_gone_after_the_load_fails_in_one_line_and_releases_all(
    held: Held, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """GetModelInfo's samples are read from the checkpoint once it loaded: a file removed meanwhile is
    the checkpoint's failure, one line as a load's is, not a traceback."""
    gone = FileNotFoundError(2, "No such file or directory", str(held.config.engine.model_dir))
    monkeypatch.setattr(serving, "checkpoint_weight_samples", raising(gone))
    assert await serving.serve(held.config) is serving.Outcome.FAILED
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [f"could not read {held.config.engine.model_dir} once loaded: {gone}"]
    held.assert_all_released()


async def test_encoder_parts_that_cannot_be_made_release_all_and_raise_on(
    held: Held, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_encoder(held)
    monkeypatch.setattr(serving, "EncoderParts", raising(RuntimeError("can't start new thread")))
    with pytest.raises(RuntimeError, match="can't start new thread"):
        await serving.serve(held.config)
    held.assert_all_released()


async def test_an_encoder_check_that_raises_other_than_a_mismatch_releases_all_and_raises_on(
    held: Held, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_encoder(held)

    async def check_model(*_: object) -> str:
        raise AssertionError("a bug in the check")

    monkeypatch.setattr(EncoderParts, "check_model", check_model)
    with pytest.raises(AssertionError, match="a bug in the check"):
        await serving.serve(held.config)
    assert held.released.count("encoder_parts.close") == 1
    held.assert_all_released()


@pytest.mark.parametrize("failing", ["freeze_startup_heap", "set_serving"])
async def test_a_start_that_fails_on_the_way_to_serving_releases_all_and_raises_on(
    held: Held, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """The engine is the servicer's by then: calls may reach it, so it is drained like a served one."""
    if failing == "set_serving":
        monkeypatch.setattr(serving.RunningServer, "set_serving", raising(RuntimeError("health failed")))
    else:
        monkeypatch.setattr(serving, "freeze_startup_heap", raising(RuntimeError("health failed")))
    with pytest.raises(RuntimeError, match="health failed"):
        await serving.serve(held.config)
    held.assert_all_released()


@pytest.mark.parametrize("failing", ["drain", "engine.shutdown"])
async def test_a_served_decoder_whose_stop_raises_still_closes_its_encoder_parts_and_telemetry(
    held: Held, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    with_encoder(held)
    monkeypatch.setattr(serving, "ENCODER_CHECK_S", 0.1)  # nothing answers: it serves after this
    if failing == "drain":
        drain = serving.drain

        async def drain_raising(running: serving.RunningServer, *args: object) -> None:
            await drain(running, *args)  # the server stopped: the error is the drain's own, after it
            raise RuntimeError("the drain failed")

        monkeypatch.setattr(serving, "drain", drain_raising)
    else:
        load = serving._load_engine

        def load_failing_shutdown(*args: object) -> Engine:
            engine = load(*args)
            shutdown = engine.shutdown

            def shutdown_raising() -> None:
                shutdown()  # its thread ended: the error is the shutdown's own, after it
                raise RuntimeError("the engine's shutdown failed")

            engine.shutdown = shutdown_raising  # type: ignore[method-assign]
            return engine

        monkeypatch.setattr(serving, "_load_engine", load_failing_shutdown)
    ready = asyncio.Event()
    serving_task = asyncio.ensure_future(serving.serve(held.config, ready))
    await asyncio.wait_for(ready.wait(), 60)
    held.stop.set()  # a SIGTERM
    with pytest.raises(RuntimeError, match="failed"):
        await serving_task
    assert held.released.count("encoder_parts.close") == 1
    held.assert_all_released()


async def test_a_load_that_raises_other_than_a_load_failure_stops_the_server_and_raises_on(
    held: Held, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the load (no engine to release): the server and the telemetry were left."""
    monkeypatch.setattr(serving, "_load_engine", raising(AssertionError("a bug in the load")))
    with pytest.raises(AssertionError, match="a bug in the load"):
        await serving.serve(held.config)
    held.assert_all_released(is_loaded=False)


async def test_encoder_parts_that_cannot_be_set_up_for_an_os_error_fail_in_one_line_naming_them(
    held: Held, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Not "could not read <checkpoint> once loaded": the parts' shared memory may be what failed."""
    with_encoder(held)
    monkeypatch.setattr(serving, "EncoderParts", raising(OSError(28, "No space left on device")))
    assert await serving.serve(held.config) is serving.Outcome.FAILED
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["could not set up the parts --encoder fetches: [Errno 28] No space left on device"]
    held.assert_all_released()


async def test_releases_taken_in_turn_keep_every_error_in_the_chain() -> None:
    """Each release is taken whatever an earlier one raised, and the error that goes on carries the
    earlier ones as its __context__, as nested `finally` blocks give: with an AsyncExitStack a failed
    drain vanished behind a failed telemetry shutdown, and a load's own error behind either."""
    taken: list[str] = []

    def step(name: str, error: Exception | None = None) -> Callable[[], None]:
        def take() -> None:
            taken.append(name)
            if error is not None:
                raise error

        return take

    drained, flushed = RuntimeError("drain"), RuntimeError("telemetry")
    with pytest.raises(RuntimeError) as raised:
        await serving._in_turn(step("drain", drained), step("engine"), step("telemetry", flushed))
    assert taken == ["drain", "engine", "telemetry"]
    assert raised.value is flushed and flushed.__context__ is drained
    loaded, stopped = ValueError("load"), RuntimeError("stop")
    with pytest.raises(RuntimeError) as raised:
        try:
            raise loaded
        except ValueError:
            await serving._in_turn(step("stop", stopped), step("telemetry"))
    assert raised.value is stopped and stopped.__context__ is loaded
