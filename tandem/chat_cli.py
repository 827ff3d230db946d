"""`tandem chat`: a multi-turn conversation with a running decoder, each reply streamed.

The conversation is kept here and sent whole each turn as a `chat` request; the server renders it
with the model's template and stops at its end-of-turn token. On a terminal each turn is prompted
for; from a pipe or a file every line is one user turn, so a chat can be scripted. `/reset` forgets
the conversation (the system message stays); end of input ends the chat.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TextIO

import click
import grpc

from tandem.client.client import DecoderClient
from tandem.common.flags import CONTEXT_SETTINGS, client_security, client_security_options, option

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
                stdout.write("[conversation reset]\n")
                continue
            if not text.strip():
                continue
            history.append({"role": "user", "content": text})
            try:
                reply = await _stream_reply(client, history, args, stdout)
            except grpc.aio.AioRpcError as error:
                print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)
                return 1
            history.append({"role": "assistant", "content": reply})


async def _stream_reply(
    client: DecoderClient, history: list[dict], args: argparse.Namespace, out: TextIO
) -> str:
    out.write("assistant> ")
    text = []
    call = client.chat(history, max_new_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    async for response in call:
        if response.HasField("delta"):
            text.append(response.delta.text)
            out.write(response.delta.text)
            out.flush()
    out.write("\n")
    out.flush()
    return "".join(text)
