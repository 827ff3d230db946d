"""`tandem generate`: stream a generation from a running decoder to the terminal.

The prompt is text (`--prompt`) and any number of `--part`s, in order: text, token IDs, the
encoder's embeddings of a text (`embed:TEXT`, from the encoder at --encoder-address), an image's
rows from that encoder (`image:FILE`, a PNG, JPEG, WebP or GIF; the prompt's text around it is yours to
write as the model's template would), or embedding rows from a file (`file:PATH`, `.npy` or
`.safetensors`, as `tandem embed --out` writes them).
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from tandem.cli_telemetry import run_traced
from tandem.common.client_security_flags import checked_client_security, client_security_options
from tandem.common.flags import (
    CONTEXT_SETTINGS,
    IMAGE_FILE_BOUND,
    MAX_IMAGE_FILE_BYTES,
    TEXT,
    UINT32,
    UINT64,
    describe_flag,
    option,
    read_flag_file,
)
from tandem.common.structured_flags import structured_choice, structured_fields, structured_options
from tandem.common.token_ids_text import is_token_ids

if TYPE_CHECKING:
    from tandem.client.pb.tandem.v1 import decoder_pb2
    from tandem.client.security import ChannelSecurity
    from tandem.client.telemetry import Telemetry

PART_KINDS = ("text", "ids", "embed", "image", "file")
PROG = "tandem generate"


@dataclass(frozen=True)
class PromptPart:
    kind: str  # one of PART_KINDS
    value: str  # the text, "1,2,3", the text to embed, or a file path (an image's, or rows')
    is_prompt: bool = False  # given as --prompt, not --part

    def flag(self) -> str:
        """How an error names this part: `--prompt`, or `--part KIND:VALUE` with a long value cut."""
        if self.is_prompt:
            return "--prompt"
        value = self.value
        if self.kind in ("text", "embed") and len(value) > 40:  # a path or IDs are said whole
            value = value[:37] + "..."
        return f"--part {self.kind}:{value}"


class _PartType(click.ParamType):
    name = "KIND:VALUE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> PromptPart:
        if isinstance(value, PromptPart):
            return value
        kind, sep, rest = str(value).partition(":")
        if not sep or kind not in PART_KINDS:
            self.fail(f"{value!r} is not KIND:VALUE with KIND one of {', '.join(PART_KINDS)}", param, ctx)
        if kind in ("text", "embed"):  # a path (file:, image:) may be any bytes the file system takes
            rest = TEXT.convert(rest, param, ctx)
        if kind == "ids" and not is_token_ids(rest):
            self.fail(
                f"{value!r}: token IDs are comma-separated integers below 2^32, e.g. ids:1,2,3", param, ctx
            )
        return PromptPart(kind, rest)


def command() -> click.Command:
    return click.Command(
        "generate",
        params=[
            option(
                "--address",
                "the decoder: host:port, several host:port,... or dns:///name:port",
                default="127.0.0.1:50052",
            ),
            option("--prompt", "text at the start of the prompt", default=None, show_default="none"),
            option(
                "--part",
                "a part of the prompt after --prompt, in order: text:TEXT, ids:1,2,3, embed:TEXT (the "
                "encoder's embeddings of TEXT), image:FILE (the encoder's rows of a PNG, JPEG, WebP or GIF) "
                "or file:PATH (.npy or .safetensors rows)",
                type=_PartType(),
                multiple=True,
                show_default="none",
            ),
            option(
                "--encoder-address", "the encoder, for embed: and image: parts", default="127.0.0.1:50051"
            ),
            option("--max-tokens", "most tokens to generate", type=UINT32, default=64),
            option("--temperature", "0 = greedy", type=float, default=None, show_default="1.0"),
            option("--top-p", "nucleus sampling", type=float, default=None, show_default="1.0, off"),
            option(
                "--top-k", "sample from the k most likely", type=UINT32, default=None, show_default="0, off"
            ),
            option("--seed", "sampling seed", type=UINT64, default=None, show_default="none, random"),
            option("--stop", "a stop string (repeatable)", multiple=True, show_default="none"),
            option(
                "--adapter",
                "a LoRA adapter the decoder has loaded, by name (GetModelInfo lists them)",
                default="",
                show_default="none, the base model",
            ),
            *structured_options(),
            option("--json", "print each raw event as JSON", is_flag=True, default=False),
            *client_security_options(),
            option(
                "--trace",
                "trace the call and print its trace id (hex) to stderr; spans are exported where "
                "OTEL_* configures an exporter (e.g. OTEL_EXPORTER_OTLP_ENDPOINT)",
                is_flag=True,
                default=False,
            ),
        ],
        callback=_start,
        help="Stream a generation from a running decoder; the prompt mixes text, token IDs and embeddings.",
        context_settings=CONTEXT_SETTINGS,
    )


def _start(**values: Any) -> int:
    from tandem.cli_errors import answering  # grpc with it: not for --help

    return answering(PROG, lambda: asyncio.run(_generate(values)))


async def _generate(values: dict[str, Any]) -> int:
    if values["prompt"] is None and not values["part"]:
        raise click.UsageError("give --prompt, one --part or more, or both")
    structured = structured_choice(values)  # click.UsageError for two at once, BadParameter for a file
    security = checked_client_security(values)  # FlagError naming the flag of a file it cannot use
    return await run_traced(PROG, values["trace"], lambda t: _stream(values, structured, security, t))


async def _stream(
    values: dict[str, Any], structured: Any, security: ChannelSecurity, telemetry: Telemetry
) -> int:
    import grpc
    from google.protobuf import json_format

    from tandem.cli_errors import EXIT_FAILED, CallFlags, failure
    from tandem.client.client import DecoderClient
    from tandem.client.pb.tandem.v1 import decoder_pb2

    given = [PromptPart("text", values["prompt"], is_prompt=True)] if values["prompt"] is not None else []
    parts = given + list(values["part"])
    try:
        prompt = await _prompt(parts, values, security, telemetry)
    except PartError as error:
        print(f"{PROG}: {error.line}", file=sys.stderr)
        return error.code
    request = decoder_pb2.GenerateRequest(prompt=prompt, adapter=values["adapter"])
    request.stopping.max_new_tokens = values["max_tokens"]
    request.stopping.stop_sequences.extend(values["stop"])
    if structured is not None:
        request.structured.CopyFrom(structured)
    for name in ("temperature", "top_p", "top_k", "seed"):
        if values[name] is not None:
            setattr(request.sampling, name, values[name])
    flags = CallFlags(
        f"{describe_flag('address')} {values['address']}", _request_flags(parts), "tandem.v1.Decoder"
    )
    is_mid_line = False  # the streamed text ended without a newline: an error starts a line of its own
    # A stream that closes OK without its `finished` event is a decoder that broke the contract (or a
    # proxy that cut it short): the answer may be incomplete, so the command must not exit 0.
    has_finished = False
    try:
        client = DecoderClient(values["address"], telemetry=telemetry, security=security)
    except ValueError as error:  # an address it cannot use
        print(f"{PROG}: {flags.address}: {error}", file=sys.stderr)
        return 2
    async with client:
        try:
            async for response in client.generate(request):
                has_finished = has_finished or response.HasField("finished")
                if values["json"]:
                    print(json.dumps(json_format.MessageToDict(response)), flush=True)
                elif response.HasField("delta"):
                    print(response.delta.text, end="", flush=True)
                    if response.delta.text:
                        is_mid_line = not response.delta.text.endswith("\n")
                elif response.HasField("finished"):
                    f = response.finished
                    reason = decoder_pb2.FinishReason.Name(f.reason)
                    print(
                        f"\n[{reason}; {f.usage.output_tokens} tokens; ttft {f.time_to_first_token_s:.3f}s]"
                    )
        except grpc.aio.AioRpcError as error:
            if is_mid_line:
                print(flush=True)
            line, code = failure(error, flags)
            print(f"{PROG}: {line}", file=sys.stderr)
            return code
    if not has_finished:
        if is_mid_line:
            print(flush=True)
        print(f"{PROG}: {flags.address}: the stream ended without its finished event", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _request_flags(parts: list[PromptPart]) -> dict[str, str]:
    """Each request field this command sets -> the flag that set it, as its errors name it."""
    fields = {
        "prompt": "--prompt / --part",
        "stopping.max_new_tokens": describe_flag("max_tokens"),
        "stopping.stop_sequences": describe_flag("stop"),
        "sampling.temperature": describe_flag("temperature"),
        "sampling.top_p": describe_flag("top_p"),
        "sampling.top_k": describe_flag("top_k"),
        "sampling.seed": describe_flag("seed"),
        "adapter": describe_flag("adapter"),
        **structured_fields(),
    }
    # --prompt with its variable, as every other flag is named (part.flag() is said outside a command too).
    fields.update(
        {
            f"prompt[{i}]": describe_flag("prompt") if part.is_prompt else part.flag()
            for i, part in enumerate(parts)
        }
    )
    return fields


class PartError(Exception):
    """A part that could not become a segment: the line saying so and the exit code."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.line = line
        self.code = code


async def _prompt(
    parts: list[PromptPart], values: dict[str, Any], security: ChannelSecurity, telemetry: Telemetry
) -> list[decoder_pb2.PromptSegment]:
    """The segments, in order; `embed:` and `image:` parts go to the encoder first. Raises PartError."""
    import grpc

    from tandem.cli_errors import CallFlags, failure
    from tandem.client.client import EncoderClient
    from tandem.client.pb.tandem.v1 import decoder_pb2, tensor_pb2
    from tandem.common.torch_part import tensors
    from tandem.embedding_files import read_embeddings

    segments = []
    encoder = None
    encoder_address = f"{describe_flag('encoder_address')} {values['encoder_address']}"
    try:
        for part in parts:
            if part.kind == "text":
                segments.append(decoder_pb2.PromptSegment(text=part.value))
            elif part.kind == "ids":
                ids = [int(i) for i in part.value.split(",")]
                segments.append(decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=ids)))
            elif part.kind == "file":
                try:
                    rows = read_embeddings(Path(part.value))
                except (ValueError, OSError) as error:  # its message starts with the path
                    raise PartError(
                        f"{part.flag()}: {str(error).removeprefix(part.value + ': ')}", 2
                    ) from None
                segments.append(decoder_pb2.PromptSegment(embeddings=tensors.encode(rows)))
            else:
                try:
                    image = (
                        read_flag_file(part.value, "--part", MAX_IMAGE_FILE_BYTES, IMAGE_FILE_BOUND)
                        if part.kind == "image"
                        else None
                    )
                except click.BadParameter as error:  # its message starts with the path
                    raise PartError(
                        f"{part.flag()}: {error.message.removeprefix(part.value + ': ')}", 2
                    ) from None
                if encoder is None:
                    try:
                        encoder = EncoderClient(
                            values["encoder_address"], telemetry=telemetry, security=security
                        )
                    except ValueError as error:
                        raise PartError(f"{encoder_address}: {error}", 2) from None
                try:
                    if image is not None:
                        embedded = await encoder.embed(image=image, timeout=60.0)
                    else:
                        embedded = await encoder.embed(text=part.value)
                except grpc.aio.AioRpcError as error:
                    flags = CallFlags(
                        encoder_address, {"text": part.flag(), "image": part.flag()}, "tandem.v1.Encoder"
                    )
                    raise PartError(*failure(error, flags)) from None
                segments.append(decoder_pb2.PromptSegment(embeddings=embedded.embeddings))
    finally:
        if encoder is not None:
            await encoder.close()
    return segments
