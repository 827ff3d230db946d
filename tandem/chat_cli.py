"""`tandem chat`: a multi-turn conversation with a running decoder, each reply streamed.

The conversation is kept here and sent whole each turn as a `chat` request; the server renders it
with the model's template and stops at its end-of-turn token. On a terminal each turn is prompted
for; from a pipe or a file every line is one user turn, so a chat can be scripted. `/reset` forgets
the conversation (the system message stays); end of input ends the chat. `--image FILE` puts a
picture in the first user turn (and again after a reset), where the model's template places an image:
a LLaVA or SmolVLM checkpoint's. A decoder with an encoder of its own gets the picture as an encoder
part and fetches its rows itself; otherwise the picture goes through `--encoder-address` first and
its rows are sent.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TextIO

import click
import grpc

from tandem.client.channel import ChannelSecurity
from tandem.client.client import DecoderClient, EncoderClient, EncoderPart, ImageRows
from tandem.common.flags import (
    CONTEXT_SETTINGS,
    client_security,
    client_security_options,
    option,
    structured_choice,
    structured_options,
)

RESET = "/reset"


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
            option("--max-tokens", "most tokens per reply", type=int, default=256),
            option("--temperature", "0 = greedy", type=float, default=0.0),
            option("--seed", "sampling seed", type=int, default=None, show_default="none, random"),
            option(
                "--image",
                "a picture (PNG, JPEG, WebP) for the first turn, through the encoder (repeatable)",
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
        callback=lambda **values: asyncio.run(run_chat(argparse.Namespace(**values), sys.stdin, sys.stdout)),
        help="Chat with a running decoder through the model's chat template, each reply streamed. On a "
        "terminal it prompts for each turn; from a pipe or a file every line is one user turn. "
        f"{RESET} starts over.",
        context_settings=CONTEXT_SETTINGS,
    )


async def run_chat(args: argparse.Namespace, stdin: TextIO, stdout: TextIO) -> int:
    try:
        security = client_security(vars(args))
    except (OSError, ValueError) as error:
        print(f"tandem chat: {error}", file=sys.stderr)
        return 2
    opening = [{"role": "system", "content": args.system}] if args.system else []
    history = list(opening)
    interactive = stdin.isatty()
    try:
        images = await _embed_images(args, security)
    except (OSError, grpc.aio.AioRpcError) as error:
        reason = (
            f"{error.code().name}: {error.details()}" if isinstance(error, grpc.aio.AioRpcError) else error
        )
        print(f"tandem chat: --image: {reason}", file=sys.stderr)
        return 1
    pending_images = list(images)  # sent with the next user turn
    async with DecoderClient(args.address, security=security) as client:
        while True:
            if interactive:
                stdout.write("you> ")
                stdout.flush()
            line = stdin.readline()
            if not line:
                return 0
            text = line.rstrip("\n")
            if text.strip() == RESET:
                history = list(opening)
                pending_images = list(images)
                stdout.write("[conversation reset]\n")
                continue
            if not text.strip():
                continue
            history.append({"role": "user", "content": [*pending_images, text] if pending_images else text})
            pending_images = []
            try:
                reply = await _stream_reply(client, history, args, stdout)
            except grpc.aio.AioRpcError as error:
                print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)
                return 1
            history.append({"role": "assistant", "content": reply})


async def _embed_images(args: argparse.Namespace, security: ChannelSecurity) -> list[ImageRows | EncoderPart]:
    """Each --image, in order: for the decoder's own encoder when it has one, else its rows from ours."""
    if not getattr(args, "image", None):
        return []
    async with DecoderClient(args.address, security=security) as decoder:
        if (await decoder.model_info()).accepts_encoder_parts:
            return [EncoderPart(image=Path(path).read_bytes()) for path in args.image]
    async with EncoderClient(args.encoder_address, security=security) as encoder:
        return [await encoder.embed_image(Path(path).read_bytes()) for path in args.image]


async def _stream_reply(
    client: DecoderClient, history: list[dict], args: argparse.Namespace, out: TextIO
) -> str:
    out.write("assistant> ")
    text = []
    structured = structured_choice(vars(args))
    extra = {"structured": structured} if structured is not None else {}
    call = client.chat(
        history, max_new_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, **extra
    )
    async for response in call:
        if response.HasField("delta"):
            text.append(response.delta.text)
            out.write(response.delta.text)
            out.flush()
    out.write("\n")
    out.flush()
    return "".join(text)
