"""`tandem chat` and Ctrl-C: a reply is cancelled alone, the prompt is never turned into an empty turn,
and a second Ctrl-C (or the end of input) leaves. The decoder is a stand-in whose reply to "hang"
streams one delta and then waits until it is cancelled; the signal is a real SIGINT to this process."""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import signal
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from tandem.chat_cli import EXIT_INTERRUPTED, LEAVE_HINT, run_chat
from tandem.cli_errors import CallFlags
from tandem.client.pb.tandem.v1 import decoder_pb2


class StandInDecoder:
    """Answers each turn with "echo <text>"; "hang" streams "partial" and then waits to be cancelled;
    "refuse" is refused before any event."""

    def __init__(self) -> None:
        self.conversations: list[list[dict]] = []  # what each call sent
        self.num_cancelled = 0

    async def __aenter__(self) -> StandInDecoder:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def chat(self, history: list[dict], **kwargs: object) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        self.conversations.append(list(history))
        return self._reply(history[-1]["content"])

    async def _reply(self, text: str) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        if text == "refuse":  # as a text-only model refuses an image: before any event
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), "no images here"
            )
        if text == "hang":
            yield _delta("partial")
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.num_cancelled += 1
                raise
        yield _delta(f"echo {text}")


def _delta(text: str) -> decoder_pb2.GenerateResponse:
    response = decoder_pb2.GenerateResponse()
    response.delta.text = text
    return response


def _args() -> argparse.Namespace:
    return argparse.Namespace(
        address="stand-in:1",
        system=None,
        max_tokens=16,
        temperature=0.0,
        seed=None,
        image=(),
        encoder_address="unused:1",
        structured=None,
        flags=CallFlags("--address stand-in:1", {}),
        encoder_flag="--encoder-address unused:1",
        tls=False,
        tls_ca=None,
        tls_cert=None,
        tls_key=None,
        auth_token_file=None,
    )


class Terminal:
    """The chat's stdin (a pipe we write lines into) and stdout (text we read back)."""

    def __init__(self) -> None:
        read_end, write_end = os.pipe()
        self._write_end: int | None = write_end
        self.stdin = os.fdopen(read_end, "r")
        self.stdout = io.StringIO()

    def type(self, line: str) -> None:
        os.write(self._write_end, line.encode())

    def end_input(self) -> None:
        if self._write_end is not None:
            os.close(self._write_end)
            self._write_end = None

    def close(self) -> None:
        self.end_input()  # the chat's reading thread ends at the end of input
        self.stdin.close()


async def _until(condition: Callable[[], bool]) -> None:
    """Until `condition` holds (the test's own timeout bounds the wait)."""
    while not condition():
        await asyncio.sleep(0.01)


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture
def terminal():
    opened = Terminal()
    yield opened
    opened.close()


async def _a_reply_cancelled(terminal: Terminal) -> tuple[StandInDecoder, asyncio.Future[int]]:
    """A chat whose reply to "hang" was cancelled by a Ctrl-C, back at its prompt."""
    decoder = StandInDecoder()
    chat = asyncio.ensure_future(run_chat(_args(), terminal.stdin, terminal.stdout, lambda *_: decoder))
    terminal.type("hang\n")
    await _until(lambda: "partial" in terminal.stdout.getvalue())
    _ctrl_c()
    await _until(lambda: "[reply cancelled]" in terminal.stdout.getvalue())
    return decoder, chat


async def test_ctrl_c_during_a_reply_cancels_that_reply_only(terminal: Terminal) -> None:
    decoder, chat = await _a_reply_cancelled(terminal)
    terminal.type("hello\n")
    terminal.end_input()
    assert await chat == 0
    assert decoder.num_cancelled == 1
    # The cancelled turn is forgotten: the next call carries only the new one.
    assert decoder.conversations[1] == [{"role": "user", "content": "hello"}]
    assert terminal.stdout.getvalue() == (
        f"assistant> partial\n[reply cancelled] {LEAVE_HINT}\nassistant> echo hello\n"
    )


async def test_ctrl_c_at_the_prompt_is_no_turn_and_a_second_one_leaves(terminal: Terminal) -> None:
    # Ctrl-C at the prompt used to be swallowed: the next line got an empty reply, then exit 130.
    decoder = StandInDecoder()
    chat = asyncio.ensure_future(run_chat(_args(), terminal.stdin, terminal.stdout, lambda *_: decoder))
    terminal.type("one\n")
    await _until(lambda: "echo one" in terminal.stdout.getvalue())  # back at the prompt
    _ctrl_c()
    await _until(lambda: LEAVE_HINT in terminal.stdout.getvalue())
    _ctrl_c()
    assert await chat == EXIT_INTERRUPTED
    assert len(decoder.conversations) == 1  # no empty turn was sent
    assert terminal.stdout.getvalue() == f"assistant> echo one\n\n{LEAVE_HINT}\n\n"


async def test_a_second_ctrl_c_after_a_cancelled_reply_leaves(terminal: Terminal) -> None:
    decoder, chat = await _a_reply_cancelled(terminal)
    _ctrl_c()
    assert await chat == EXIT_INTERRUPTED
    assert decoder.num_cancelled == 1 and len(decoder.conversations) == 1


async def test_the_end_of_input_leaves_with_zero(terminal: Terminal) -> None:
    decoder = StandInDecoder()
    terminal.type("one\ntwo\n")
    terminal.end_input()
    assert await run_chat(_args(), terminal.stdin, terminal.stdout, lambda *_: decoder) == 0
    assert terminal.stdout.getvalue() == "assistant> echo one\nassistant> echo two\n"
    assert decoder.conversations[1][1] == {"role": "assistant", "content": "echo one"}


async def test_a_refused_turn_prints_no_empty_reply_before_its_error(
    terminal: Terminal, capsys: pytest.CaptureFixture[str]
) -> None:
    # `tandem chat --image` on a text-only model printed "assistant> " and then the error.
    decoder = StandInDecoder()
    terminal.type("one\nrefuse\n")
    terminal.end_input()
    assert await run_chat(_args(), terminal.stdin, terminal.stdout, lambda *_: decoder) != 0
    assert terminal.stdout.getvalue() == "assistant> echo one\n"
    assert "no images here" in capsys.readouterr().err
