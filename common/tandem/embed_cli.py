"""`tandem embed`: text, token IDs or an image -> embeddings from a running encoder.

Without `--out`, a summary on the terminal: the shape and dtype, the token IDs, the rows' norms and
the first values. With `--out FILE.npy` or `FILE.safetensors`, the rows go to the file
(`tandem.embedding_files`), ready for `tandem generate --part file:FILE`. An image's rows (a LLaVA
or SmolVLM checkpoint's encoder) are its whole span, what `EncoderClient.embed_image` returns: the
rows that replace the chat template's `<image>`, with the span's token IDs beside them.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from tandem.cli_telemetry import run_traced
from tandem.common.client_security_flags import checked_client_security, client_security_options
from tandem.common.dtypes import BY_NAME, FLOAT_NAMES
from tandem.common.flags import (
    CONTEXT_SETTINGS,
    IMAGE_FILE_BOUND,
    MAX_IMAGE_FILE_BYTES,
    PATH,
    describe_flag,
    option,
    read_flag_file,
)
from tandem.common.token_ids_text import is_token_ids

if TYPE_CHECKING:
    from tandem.client.security import ChannelSecurity
    from tandem.client.telemetry import Telemetry

PROG = "tandem embed"


def command() -> click.Command:
    return click.Command(
        "embed",
        params=[
            option(
                "--address",
                "the encoder: host:port, several host:port,... or dns:///name:port",
                default="127.0.0.1:50051",
            ),
            option("--text", "the text to embed", default=None, show_default="none"),
            option(
                "--ids",
                "token IDs to embed instead, comma-separated: 1,2,3",
                default=None,
                show_default="none",
            ),
            option(
                "--image",
                "a picture (PNG, JPEG, WebP or GIF) to embed instead: its span's rows, from a LLaVA or "
                "SmolVLM checkpoint's encoder",
                type=PATH,
                default=None,
                show_default="none",
            ),
            option(
                "--dtype",
                "dtype of the returned rows",
                type=click.Choice(FLOAT_NAMES),
                default=None,
                show_default="the encoder's",
            ),
            option(
                "--pooling",
                "none: one row per token; mean: one row",
                type=click.Choice(("none", "mean")),
                default=None,
                show_default="the encoder's",
            ),
            option(
                "--out",
                "write the rows to FILE: .npy (bfloat16 as float32) or .safetensors (with the token IDs)",
                type=_OUT_FILE,
                default=None,
                show_default="none, a summary on the terminal",
            ),
            *client_security_options(),
            option(
                "--trace",
                "trace the call and print its trace id (hex) to stderr",
                is_flag=True,
                default=False,
            ),
        ],
        callback=_start,
        help="Embed a text, token IDs or an image with a running encoder: a summary, or the rows in a file.",
        context_settings=CONTEXT_SETTINGS,
    )


class _OutFile(type(PATH)):  # type: ignore[misc]
    """A file to write: a name ending in "/" names a folder, which Path() dropped (`--out x.npy/` wrote
    the file x.npy)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.endswith(("/", os.sep)):
            self.fail(f"{value} ends in '/', a folder's name: name the file", param, ctx)
        return super().convert(value, param, ctx)


_OUT_FILE = _OutFile(path_type=Path)


def _start(**values: Any) -> int:
    from tandem.cli_errors import answering  # grpc with it: not for --help

    return answering(PROG, lambda: asyncio.run(_embed(values)))


async def _embed(values: dict[str, Any]) -> int:
    from tandem.embedding_files import SUFFIXES

    if sum(values[name] is not None for name in ("text", "ids", "image")) != 1:
        raise click.UsageError("give exactly one of --text, --ids and --image")
    if values["ids"] is not None and not is_token_ids(values["ids"]):
        raise click.BadParameter(
            f"{values['ids']!r}: comma-separated integers below 2^32, e.g. 1,2,3", param_hint="'--ids'"
        )
    if values["out"] is not None and values["out"].suffix not in SUFFIXES:
        raise click.BadParameter(
            f"{values['out']}: the file name must end in {' or '.join(SUFFIXES)}", param_hint="'--out'"
        )
    image = None
    if values["image"] is not None:
        image = read_flag_file(values["image"], "--image", MAX_IMAGE_FILE_BYTES, IMAGE_FILE_BOUND)
    security = checked_client_security(values)  # FlagError naming the flag of a file it cannot use
    return await run_traced(PROG, values["trace"], lambda t: _call(values, image, security, t))


async def _call(
    values: dict[str, Any], image: bytes | None, security: ChannelSecurity, telemetry: Telemetry
) -> int:
    import grpc

    from tandem.cli_errors import CallFlags, failure
    from tandem.client.client import EncoderClient
    from tandem.client.pb.tandem.v1 import encoder_pb2, tensor_pb2
    from tandem.common.torch_part import tensors

    dtype = tensor_pb2.DATA_TYPE_UNSPECIFIED
    if values["dtype"] is not None:
        dtype = BY_NAME[values["dtype"]].wire
    pooling = encoder_pb2.POOLING_UNSPECIFIED
    if values["pooling"] is not None:
        pooling = encoder_pb2.Pooling.Value(f"POOLING_{values['pooling'].upper()}")
    ids = None if values["ids"] is None else [int(i) for i in values["ids"].split(",")]
    flags = CallFlags(
        f"{describe_flag('address')} {values['address']}",
        {
            "text": describe_flag("text"),
            "token_ids": describe_flag("ids"),
            "image": describe_flag("image"),
            "output_dtype": describe_flag("dtype"),
            "pooling": describe_flag("pooling"),
        },
        "tandem.v1.Encoder",
    )
    try:
        client = EncoderClient(values["address"], telemetry=telemetry, security=security)
    except ValueError as error:  # an address it cannot use
        print(f"{PROG}: {flags.address}: {error}", file=sys.stderr)
        return 2
    async with client:
        try:
            response = await client.embed(
                text=values["text"],
                token_ids=ids,
                image=image,
                output_dtype=dtype,
                pooling=pooling,
                timeout=60.0 if image is not None else 30.0,  # a tower pass, EncoderClient.embed_image's
            )
        except grpc.aio.AioRpcError as error:
            line, code = failure(error, flags)
            print(f"{PROG}: {line}", file=sys.stderr)
            return code
    rows = tensors.decode(response.embeddings, "embeddings")  # [n, hidden_size]
    token_ids = list(response.token_ids.ids)
    if values["out"] is None:
        print(summary(rows, token_ids, response.placeholder))
        return 0
    from tandem.embedding_files import write_embeddings

    try:
        stored = write_embeddings(Path(values["out"]), rows, token_ids)
    except OSError as error:  # a folder that does not exist, a file it may not write
        raise click.BadParameter(f"{values['out']}: {error.strerror}", param_hint="'--out'") from None
    print(
        f"wrote {values['out']}: embeddings {list(stored.shape)} {str(stored.dtype).removeprefix('torch.')}"
    )
    return 0


def summary(rows: Any, token_ids: list[int], placeholder: str = "") -> str:
    """What a person wants to see of rows [n, hidden_size]: shape, dtype, tokens, norms, first values;
    for an image's span, the placeholder its rows replace."""
    norms = rows.float().norm(dim=-1)  # [n]
    first = ", ".join(f"{v:.4f}" for v in rows[0, :6].float().tolist())
    ids = ", ".join(map(str, token_ids[:16])) + (", ..." if len(token_ids) > 16 else "")
    dtype = str(rows.dtype).removeprefix("torch.")
    source = f"{len(token_ids)} tokens"
    if placeholder:
        source = f"an image's span of {source} (it replaces {placeholder})"
    return "\n".join(
        [
            f"embeddings {list(rows.shape)} {dtype} from {source}",
            f"token IDs: {ids}",
            f"row norms: min {norms.min():.4f}, mean {norms.mean():.4f}, max {norms.max():.4f}",
            f"row 0: [{first}, ...]",
        ]
    )
