"""`tandem chat`: a multi-turn conversation with a running decoder, each reply streamed.

The conversation is kept here and sent whole each turn as a `chat` request; the server renders it
with the model's template and stops at its end-of-turn token. On a terminal each turn is prompted
for; from a pipe or a file every line is one user turn, so a chat can be scripted. `/reset` forgets
the conversation (the system message stays); end of input ends the chat.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

import grpc

from common.client import ChannelSecurity, DecoderClient

RESET = "/reset"


async def run_chat(args: argparse.Namespace, stdin: TextIO, stdout: TextIO) -> int:
    try:
        security = ChannelSecurity.from_files(
            args.tls_ca, args.tls_cert, args.tls_key, args.auth_token_file, is_tls=args.tls
        )
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
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
