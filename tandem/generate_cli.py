"""`tandem generate`: stream a generation from a running decoder to the terminal.

The prompt is text (`--prompt`) and any number of `--part`s, in order: text, token IDs, the
encoder's embeddings of a text (`embed:TEXT`, from the encoder at --encoder-address), an image's
rows from that encoder (`image:FILE`, a PNG, JPEG or WebP; the prompt's text around it is yours to
write as the model's template would), or embedding rows from a file (`file:PATH`, `.npy` or
`.safetensors`, as `tandem embed --out` writes them).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from tandem.common.flags import (
    CONTEXT_SETTINGS,
    client_security,
    client_security_options,
    option,
    structured_choice,
    structured_options,
)

if TYPE_CHECKING:
    from tandem.client.channel import ChannelSecurity
    from tandem.client.pb.tandem.v1 import decoder_pb2
    from tandem.client.telemetry import Telemetry

PART_KINDS = ("text", "ids", "embed", "image", "file")


@dataclass(frozen=True)
class PromptPart:
    kind: str  # one of PART_KINDS
    value: str  # the text, "1,2,3", the text to embed, or a file path (an image's, or rows')


class _PartType(click.ParamType):
    name = "KIND:VALUE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> PromptPart:
        if isinstance(value, PromptPart):
            return value
        kind, sep, rest = str(value).partition(":")
        if not sep or kind not in PART_KINDS:
            self.fail(f"{value!r} is not KIND:VALUE with KIND one of {', '.join(PART_KINDS)}", param, ctx)
        if kind == "ids" and not all(i.strip().isdigit() for i in rest.split(",")):
            self.fail(f"{value!r}: token IDs are comma-separated integers, e.g. ids:1,2,3", param, ctx)
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
                "encoder's embeddings of TEXT), image:FILE (the encoder's rows of a PNG, JPEG or WebP) "
                "or file:PATH (.npy or .safetensors rows)",
                type=_PartType(),
                multiple=True,
                show_default="none",
            ),
            option(
                "--encoder-address", "the encoder, for embed: and image: parts", default="127.0.0.1:50051"
            ),
            option("--max-tokens", "most tokens to generate", type=int, default=64),
            option("--temperature", "0 = greedy", type=float, default=None, show_default="1.0"),
            option("--top-p", "nucleus sampling", type=float, default=None, show_default="1.0, off"),
            option("--top-k", "sample from the k most likely", type=int, default=None, show_default="0, off"),
            option("--seed", "sampling seed", type=int, default=None, show_default="none, random"),
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
        callback=lambda **values: asyncio.run(_generate(values)),
        help="Stream a generation from a running decoder; the prompt mixes text, token IDs and embeddings.",
        context_settings=CONTEXT_SETTINGS,
    )


async def _generate(values: dict[str, Any]) -> int:
    if values["prompt"] is None and not values["part"]:
        raise click.UsageError("give --prompt, one --part or more, or both")
    try:
        security = client_security(values)
    except (OSError, ValueError) as error:
        print(f"tandem generate: {error}", file=sys.stderr)
        return 2
    return await run_traced("tandem generate", values["trace"], lambda t: _stream(values, security, t))


async def run_traced(name: str, is_traced: bool, run: Callable[[Telemetry], Awaitable[int]]) -> int:
    """`run` under a client span named `name`, exported where OTEL_* says; `is_traced` also makes a
    trace id when it says nothing, and prints it."""
    from opentelemetry import trace

    from tandem.client.telemetry import setup_telemetry

    telemetry = setup_telemetry("tandem-cli", os.environ, always_trace=is_traced)
    try:
        with telemetry.tracer.start_as_current_span(name, kind=trace.SpanKind.CLIENT) as span:
            if is_traced:
                print(f"trace id: {trace.format_trace_id(span.get_span_context().trace_id)}", file=sys.stderr)
            return await run(telemetry)
    finally:
        telemetry.shutdown()


async def _stream(values: dict[str, Any], security: ChannelSecurity, telemetry: Telemetry) -> int:
    import grpc
    from google.protobuf import json_format

    from tandem.client.client import DecoderClient
    from tandem.client.pb.tandem.v1 import decoder_pb2

    try:
        prompt = await _prompt(values, security, telemetry)
    except (ValueError, OSError, grpc.aio.AioRpcError) as error:
        reason = (
            f"{error.code().name}: {error.details()}" if isinstance(error, grpc.aio.AioRpcError) else error
        )
        print(f"tandem generate: --part: {reason}", file=sys.stderr)
        return 1
    request = decoder_pb2.GenerateRequest(prompt=prompt, adapter=values["adapter"])
    request.stopping.max_new_tokens = values["max_tokens"]
    request.stopping.stop_sequences.extend(values["stop"])
    try:
        structured = structured_choice(values)
    except OSError as error:
        print(f"tandem generate: {error}", file=sys.stderr)
        return 1
    if structured is not None:
        request.structured.CopyFrom(structured)
    for name in ("temperature", "top_p", "top_k", "seed"):
        if values[name] is not None:
            setattr(request.sampling, name, values[name])
    async with DecoderClient(values["address"], telemetry=telemetry, security=security) as client:
        try:
            async for response in client.generate(request):
                if values["json"]:
                    print(json.dumps(json_format.MessageToDict(response)), flush=True)
                elif response.HasField("delta"):
                    print(response.delta.text, end="", flush=True)
                elif response.HasField("finished"):
                    f = response.finished
                    reason = decoder_pb2.FinishReason.Name(f.reason)
                    print(
                        f"\n[{reason}; {f.usage.output_tokens} tokens; ttft {f.time_to_first_token_s:.3f}s]"
                    )
        except grpc.aio.AioRpcError as error:
            print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    return 0


async def _prompt(
    values: dict[str, Any], security: ChannelSecurity, telemetry: Telemetry
) -> list[decoder_pb2.PromptSegment]:
    """The segments, in order; `embed:` and `image:` parts go to the encoder first. Raises ValueError
    (OSError included), AioRpcError."""
    from tandem.client.client import EncoderClient
    from tandem.client.pb.tandem.v1 import decoder_pb2, tensor_pb2
    from tandem.common import tensors
    from tandem.embedding_files import read_embeddings

    parts = ([PromptPart("text", values["prompt"])] if values["prompt"] is not None else []) + list(
        values["part"]
    )
    segments = []
    encoder = None
    try:
        for part in parts:
            if part.kind == "text":
                segments.append(decoder_pb2.PromptSegment(text=part.value))
            elif part.kind == "ids":
                ids = [int(i) for i in part.value.split(",")]
                segments.append(decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=ids)))
            elif part.kind == "file":
                rows = read_embeddings(Path(part.value))
                segments.append(decoder_pb2.PromptSegment(embeddings=tensors.encode(rows)))
            else:
                image = Path(part.value).read_bytes() if part.kind == "image" else None
                if encoder is None:
                    encoder = EncoderClient(values["encoder_address"], telemetry=telemetry, security=security)
                if image is not None:
                    embedded = await encoder.embed(image=image, timeout=60.0)
                else:
                    embedded = await encoder.embed(text=part.value)
                segments.append(decoder_pb2.PromptSegment(embeddings=embedded.embeddings))
    finally:
        if encoder is not None:
            await encoder.close()
    return segments
