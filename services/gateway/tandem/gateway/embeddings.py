"""/v1/embeddings answers: their size bounded before any work, and written piece by piece.

NOTE: the amplification. A body of token IDs is 2-6 bytes an ID; its answer without pooling is a
row of `hidden_size` floats an ID, 4 bytes each and 4/3 of that in base64: 32 inputs of 8,000 IDs
(a 1.28 MB body) ask for a 786 MB answer from SmolLM2. So the answer's largest size is reckoned from
the inputs alone, before any encoder call (rows x width x inputs: `answer_bound`), and a body past
`--max-embeddings-bytes` is refused 413 naming `input`. What is under it is written as it is encoded,
each reply's rows straight from the encoder's bytes to base64 in 1 MiB pieces (`write_answer`), so
the gateway holds the replies and one piece, never a list of floats, a base64 copy and the whole JSON
at once, and its event loop never encodes for more than a millisecond or so at a time.
"""

from __future__ import annotations

import array
import base64
import json
import sys

from aiohttp import web

from tandem.client.pb.tandem.v1 import encoder_pb2
from tandem.gateway.calls import EmbedCall
from tandem.gateway.errors import HttpError, Refused

# Base64 is written in slices of this many bytes of rows (a multiple of 3, so the pieces join up).
PIECE_BYTES = 3 * 256 * 1024
# A float32 as JSON, at most: "-1.2345678901234567e-05, " (Python prints a float32's double exactly).
JSON_FLOAT_BYTES = 25
# Special tokens a tokenizer may add to a text beyond one position per UTF-8 byte.
SPECIAL_TOKENS = 8
# The JSON around one embedding and around the list.
ITEM_BYTES = 64
LIST_BYTES = 512


def answer_bound(call: EmbedCall, info: encoder_pb2.EncoderGetModelInfoResponse) -> int:
    """The most bytes the answer to `call` can take: each input's most rows (one when mean-pooled; else
    its token IDs, a text's UTF-8 bytes, an image's span, each at most max_input_tokens, plus a soft
    prompt's rows) x the encoder's width x the bytes a value takes in the asked encoding."""
    value_bytes = 16 / 3 if call.is_base64 else JSON_FLOAT_BYTES  # 4 bytes as base64, or as JSON text
    num_rows = 0
    for request in call.requests:
        if request.pooling == encoder_pb2.POOLING_MEAN:
            num_rows += 1
            continue
        kind = request.WhichOneof("input")
        if kind == "token_ids":
            positions = len(request.token_ids.ids)
        elif kind == "text":
            positions = len(request.text.encode()) + SPECIAL_TOKENS
        else:
            positions = info.max_input_tokens
        num_rows += min(positions, info.max_input_tokens) + info.num_virtual_tokens
    return int(num_rows * info.hidden_size * value_bytes) + ITEM_BYTES * len(call.requests) + LIST_BYTES


def check_answer_size(call: EmbedCall, info: encoder_pb2.EncoderGetModelInfoResponse, limit: int) -> None:
    """Refused (413 naming `input`) when `call`'s answer could be larger than `limit` bytes."""
    bound = answer_bound(call, info)
    if bound > limit:
        message = (
            f"input: the embeddings of these inputs could take {bound} bytes (rows x {info.hidden_size} "
            f"values), over the gateway's --max-embeddings-bytes {limit}; send fewer or shorter inputs, or "
            "pool them (tandem_pooling mean)"
        )
        raise Refused(HttpError(413, "invalid_request_error", message, "input"))


def check_reply_sizes(
    call: EmbedCall, info: encoder_pb2.EncoderGetModelInfoResponse, max_message_bytes: int
) -> None:
    """Refused (413 naming the input) when an input of token IDs asks for a reply over the gateway's
    `max_message_bytes`: its rows (one an ID, plus a soft prompt's) x the width x 4 bytes, and each ID
    again (a varint of a byte at least). Sent, the gateway's channel refused the reply after the encoder
    had computed it. Only token IDs are counted: a text's or a picture's rows are known only once read
    (`answer_bound` takes their most), and one that is still over is named by `image_bytes.over_cap`."""
    for i, request in enumerate(call.requests):
        if request.pooling == encoder_pb2.POOLING_MEAN or request.WhichOneof("input") != "token_ids":
            continue
        num_ids = len(request.token_ids.ids)
        num_rows = num_ids + info.num_virtual_tokens
        num_bytes = num_rows * info.hidden_size * 4 + num_ids
        if num_bytes > max_message_bytes:
            where = call.input_field(i, "token_ids")
            message = (
                f"{where}: its reply from the encoder is at least {num_bytes} bytes ({num_rows} rows x "
                f"{info.hidden_size} values x 4 bytes, and its {num_ids} token IDs), over the gateway's "
                f"--max-message-bytes of {max_message_bytes}; send fewer token IDs, or pool them "
                "(tandem_pooling mean)"
            )
            raise Refused(HttpError(413, "invalid_request_error", message, where))


async def write_answer(
    request: web.Request,
    call: EmbedCall,
    replies: list[encoder_pb2.EmbedResponse | None],
    model: str,
) -> web.StreamResponse:
    """The OpenAI list of embeddings, written as it is encoded; each reply is dropped once written."""
    num_tokens = sum(reply.usage.input_tokens for reply in replies)
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    tail = ('],"model":' + json.dumps(model) + ',"usage":' + json.dumps(usage) + "}").encode()
    items: list[tuple[bytes, bytes, bytes]] = []  # per reply: its JSON before, the rows (raw), after
    for i in range(len(replies)):
        reply, replies[i] = replies[i], None  # one reply's bytes held twice at a time, at most
        before = f'{"," if i else ""}{{"object":"embedding","index":{i},"embedding":'.encode()
        if call.is_base64:
            items.append((before + b'"', reply.embeddings.data, b'"}'))
        else:  # mean-pooled, one row (embed_request refuses JSON floats without pooling)
            values = float32_values(reply.embeddings.data)
            items.append((before + json.dumps(values, separators=(",", ":")).encode() + b"}", b"", b""))
    head = b'{"object":"list","data":['
    length = len(head) + len(tail) + sum(len(b) + _base64_length(len(r)) + len(a) for b, r, a in items)
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = length
    await response.prepare(request)
    await response.write(head)
    for k, (before, rows, after) in enumerate(items):
        await response.write(before)
        for start in range(0, len(rows), PIECE_BYTES):
            await response.write(base64.b64encode(memoryview(rows)[start : start + PIECE_BYTES]))
        await response.write(after)
        items[k] = (b"", b"", b"")  # this reply's bytes may go now
    await response.write(tail)
    await response.write_eof()
    return response


def _base64_length(num_bytes: int) -> int:
    return 4 * ((num_bytes + 2) // 3)


def float32_values(data: bytes) -> list[float]:
    """Little-endian float32 bytes as Python floats (each the float32's exact double). The standard
    library's array, not numpy: the gateway loads no numerical library for one row."""
    values = array.array("f", data)  # [len(data) // 4]
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
