"""`tandem chat`: a multi-turn conversation with a running decoder, each reply streamed.

The conversation is kept here and sent whole each turn as a `chat` request; the server renders it
with the model's template and stops at its end-of-turn token. On a terminal each turn is prompted
for; from a pipe or a file every line is one user turn, so a chat can be scripted. `/reset` forgets
the conversation (the system message stays); end of input (Ctrl-D) ends the chat. `--image FILE` puts
a picture in the first user turn (and again after a reset), where the model's template places an
image: a LLaVA or SmolVLM checkpoint's. A decoder with an encoder of its own gets the picture as an
encoder part and fetches its rows itself; otherwise the picture goes through `--encoder-address` first
and its rows are sent.

Ctrl-C during a reply cancels that reply only: its turn is forgotten and the prompt comes back. A
second Ctrl-C with no line entered in between (or one at the prompt after a hint) leaves, exit 130.
Lines are read on a thread of their own, so the event loop, and with it the signal, is never stuck in
a blocking read.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import click
import grpc

from tandem.cli_errors import CallFlags, answering, failure
from tandem.client.client import DecoderClient, EncoderClient, EncoderPart, ImageRows
from tandem.client.security import ChannelSecurity
from tandem.common.client_security_flags import checked_client_security, client_security_options
from tandem.common.flags import (
    CONTEXT_SETTINGS,
    IMAGE_FILE_BOUND,
    MAX_IMAGE_FILE_BYTES,
    UINT32,
    UINT64,
    FlagError,
    describe_flag,
    option,
    read_flag_file,
)
from tandem.common.structured_flags import structured_choice, structured_fields, structured_options

PROG = "tandem chat"
RESET = "/reset"
LEAVE_HINT = "(Ctrl-C again or Ctrl-D leaves)"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def command() -> click.Command:
    return click.Command(
        "chat",
        params=[
            option(
                "--address",
                "the decoder: host:port, several host:port,... or dns:///name:port",
                default="127.0.0.1:50052",
            ),
            option(
                "--system", "a system message opening the conversation", default=None, show_default="none"
            ),
            option("--max-tokens", "most tokens per reply", type=UINT32, default=256),
            option("--temperature", "0 = greedy", type=float, default=0.0),
            option("--seed", "sampling seed", type=UINT64, default=None, show_default="none, random"),
            option(
                "--image",
                "a picture (PNG, JPEG, WebP, GIF) for the first turn, through the encoder (repeatable)",
                type=click.Path(exists=True, dir_okay=False),
                multiple=True,
                show_default="none",
            ),
            option(
                "--encoder-address",
                "the encoder, for --image when the decoder has none of its own",
                default="127.0.0.1:50051",
            ),
            *structured_options(),
            *client_security_options(),
        ],
        callback=_start,
        help="Chat with a running decoder through the model's chat template, each reply streamed. On a "
        "terminal it prompts for each turn; from a pipe or a file every line is one user turn. "
        f"{RESET} starts over; Ctrl-C cancels a reply, a second Ctrl-C (or Ctrl-D) leaves.",
        context_settings=CONTEXT_SETTINGS,
    )


def _start(**values: Any) -> int:
    structured = structured_choice(values)  # click.UsageError for two at once, BadParameter for a file
    fields = {
        "stopping.max_new_tokens": describe_flag("max_tokens"),
        "sampling.temperature": describe_flag("temperature"),
        "sampling.seed": describe_flag("seed"),
        **structured_fields(),
    }
    if values["system"]:
        fields["chat.messages[0]"] = describe_flag("system")
    first_turn = 1 if values["system"] else 0  # where the pictures go, on the first turn and after a reset
    for j, path in enumerate(values["image"]):  # a part the decoder's encoder refuses names its file
        fields[f"chat.messages[{first_turn}].content[{j}]"] = f"--image {path}"
    flags = CallFlags(f"{describe_flag('address')} {values['address']}", fields, "tandem.v1.Decoder")
    encoder_flag = f"{describe_flag('encoder_address')} {values['encoder_address']}"
    # Read before the chat starts: each a regular file within the bound (BadParameter naming --image).
    pictures = [
        read_flag_file(path, "--image", MAX_IMAGE_FILE_BYTES, IMAGE_FILE_BOUND) for path in values["image"]
    ]
    args = argparse.Namespace(
        **values, structured=structured, flags=flags, encoder_flag=encoder_flag, pictures=pictures
    )
    if sys.stdin is None:  # closed (`<&-`): no turn to read, the end of input at once
        with open(os.devnull) as nothing:
            return answering(PROG, lambda: asyncio.run(run_chat(args, nothing, sys.stdout)))
    return answering(PROG, lambda: asyncio.run(run_chat(args, sys.stdin, sys.stdout)))


async def run_chat(
    args: argparse.Namespace,
    stdin: TextIO,
    stdout: TextIO,
    connect: Callable[[str, ChannelSecurity], DecoderClient] = lambda address, security: DecoderClient(
        address, security=security
    ),
) -> int:
    """The chat; its exit code. `connect(address, security)` makes the decoder's client."""
    try:
        security = checked_client_security(vars(args))
    except FlagError as error:
        print(f"{PROG}: {error.message}", file=sys.stderr)
        return 2
    opening = [{"role": "system", "content": args.system}] if args.system else []
    try:
        decoder = connect(args.address, security)
    except ValueError as error:  # an address it cannot use
        print(f"{PROG}: {args.flags.address}: {error}", file=sys.stderr)
        return 2
    async with decoder as client:
        return await _converse(args, client, security, opening, stdin, stdout)


async def _converse(
    args: argparse.Namespace,
    client: DecoderClient,
    security: ChannelSecurity,
    opening: list[dict],
    stdin: TextIO,
    stdout: TextIO,
) -> int:
    """The turns over `client`, each --image in the first; the exit code."""
    images: list[ImageRows | EncoderPart] = []
    if args.image:
        try:
            fetches_rows = (await client.model_info()).accepts_encoder_parts
        except grpc.aio.AioRpcError as error:
            return _failed(error, args.flags)
        try:
            images = await _image_parts(args, fetches_rows, security)
        except grpc.aio.AioRpcError as error:
            return _failed(error, CallFlags(args.encoder_flag, {"image": "--image"}, "tandem.v1.Encoder"))
    history = list(opening)
    pending_images = list(images)  # sent with the next user turn
    interactive = stdin.isatty()
    lines = _LineReader(stdin)
    interrupts = _Interrupts(asyncio.get_running_loop(), stdout, interactive)
    try:
        while True:
            if interactive:
                stdout.write("you> ")
                stdout.flush()
            line = await interrupts.unless_leaving(lines.next())
            if line is None:  # a second Ctrl-C
                stdout.write("\n")
                return EXIT_INTERRUPTED
            if not line:  # end of input: Ctrl-D on a terminal
                if interactive:
                    stdout.write("\n")
                return 0
            interrupts.is_armed = False  # a line was entered: one Ctrl-C cancels again
            text = line.rstrip("\n")
            if text.strip() == RESET:
                history = list(opening)
                pending_images = list(images)
                stdout.write("[conversation reset]\n")
                continue
            if not text.strip():
                continue
            turn = {"role": "user", "content": [*pending_images, text] if pending_images else text}
            shown = _Shown()
            reply_task = asyncio.ensure_future(_stream_reply(client, [*history, turn], args, stdout, shown))
            interrupts.reply = reply_task
            try:
                reply = await reply_task
            except asyncio.CancelledError:
                if interrupts.is_leaving:
                    stdout.write("\n")
                    return EXIT_INTERRUPTED
                start = "\n" if shown.is_shown else ""
                stdout.write(f"{start}[reply cancelled] {LEAVE_HINT}\n")  # the turn is forgotten
                continue
            except grpc.aio.AioRpcError as error:
                if shown.is_shown:  # the error starts a line of its own
                    stdout.write("\n")
                    stdout.flush()
                return _failed(error, args.flags)
            finally:
                interrupts.reply = None
            history += [turn, {"role": "assistant", "content": reply}]
            pending_images = []
    finally:
        interrupts.close()


class _Interrupts:
    """SIGINT while chatting: the first cancels the reply in flight (or, at the prompt, only arms);
    one more before a line is entered leaves."""

    def __init__(self, loop: asyncio.AbstractEventLoop, out: TextIO, interactive: bool) -> None:
        self.reply: asyncio.Future[str] | None = None  # the reply streaming now
        self.is_armed = False  # a Ctrl-C since the last line entered: the next one leaves
        self.is_leaving = False
        self._leave = loop.create_future()
        self._loop = loop
        self._out = out
        self._prompt = "you> " if interactive else ""
        loop.add_signal_handler(signal.SIGINT, self._on_interrupt)

    def _on_interrupt(self) -> None:
        if self.is_armed:
            self.is_leaving = True
            if not self._leave.done():
                self._leave.set_result(None)
            if self.reply is not None:
                self.reply.cancel()
            return
        self.is_armed = True
        if self.reply is not None:
            self.reply.cancel()
        else:  # at the prompt: nothing to cancel, say how to leave
            self._out.write(f"\n{LEAVE_HINT}\n{self._prompt}")
            self._out.flush()

    async def unless_leaving(self, line: asyncio.Future[str]) -> str | None:
        """The line, or None when a second Ctrl-C comes first (the read then stays pending)."""
        await asyncio.wait([line, self._leave], return_when=asyncio.FIRST_COMPLETED)
        return line.result() if line.done() else None

    def close(self) -> None:
        self._loop.remove_signal_handler(signal.SIGINT)


class _LineReader:
    """The lines of a stream, read on a daemon thread from its file descriptor (type-ahead is kept).

    Not through the stream's own buffer: a daemon thread blocked in its readline holds that buffer's
    lock, and Python's exit, closing stdin, then aborts ("could not acquire lock ... at interpreter
    shutdown"). A thread blocked in os.read holds nothing, so the chat can leave while it waits.
    """

    def __init__(self, stream: TextIO) -> None:
        self._fd = stream.fileno()
        self._lines: asyncio.Queue[str] = asyncio.Queue()
        self._next: asyncio.Future[str] | None = None
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, args=(loop,), name="chat-stdin", daemon=True).start()

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pending = ""
        while True:
            chunk = os.read(self._fd, 65536)
            pending += decoder.decode(chunk, final=not chunk)
            *lines, pending = pending.split("\n")
            lines = [line + "\n" for line in lines]
            if not chunk:  # end of input: what is left (a line without its newline), then ""
                lines += [pending, ""] if pending else [""]
            try:
                for line in lines:
                    loop.call_soon_threadsafe(self._lines.put_nowait, line)
            except RuntimeError:  # the loop is closed: the chat is over
                return
            if not chunk:
                return

    def next(self) -> asyncio.Future[str]:
        """The next line ("" at the end of input); the same one until it has been taken."""
        if self._next is None or self._next.done():
            self._next = asyncio.ensure_future(self._lines.get())
        return self._next


def _failed(error: grpc.aio.AioRpcError, flags: CallFlags) -> int:
    """Says on stderr that a call failed, naming the flag to change; the exit code."""
    line, code = failure(error, flags)
    print(f"{PROG}: {line}", file=sys.stderr)
    return code


async def _image_parts(
    args: argparse.Namespace, fetches_rows: bool, security: ChannelSecurity
) -> list[ImageRows | EncoderPart]:
    """Each --image, in order: an encoder part when the decoder fetches the rows itself, else the
    rows from --encoder-address."""
    if fetches_rows:
        return [EncoderPart(image=picture) for picture in args.pictures]
    async with EncoderClient(args.encoder_address, security=security) as encoder:
        return [await encoder.embed_image(picture) for picture in args.pictures]


@dataclass
class _Shown:
    """Whether a reply's `assistant> ` is on screen yet."""

    is_shown: bool = False


async def _stream_reply(
    client: DecoderClient, history: list[dict], args: argparse.Namespace, out: TextIO, shown: _Shown
) -> str:
    """The reply's text, streamed to `out` after `assistant> `, which is written only once the decoder
    has answered: a refused turn (an image for a text-only model) printed an empty `assistant> `
    before its error."""
    text = []
    extra = {"structured": args.structured} if args.structured is not None else {}
    call = client.chat(
        history, max_new_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, **extra
    )
    async for response in call:
        if not shown.is_shown:
            shown.is_shown = True
            out.write("assistant> ")
        if response.HasField("delta"):
            text.append(response.delta.text)
            out.write(response.delta.text)
            out.flush()
    if not shown.is_shown:  # a stream with no event at all: still one (empty) reply line
        out.write("assistant> ")
    out.write("\n")
    out.flush()
    return "".join(text)
