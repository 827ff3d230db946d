"""POST /v1/embeddings bodies -> one Embed request per input. Every repeated field is counted
(`body_limits.py`) before its first element is converted."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import encoder_pb2, tensor_pb2
from tandem.gateway.body_limits import MAX_IMAGES, MAX_INPUTS, BodyLimits, at_most
from tandem.gateway.calls import EmbedCall
from tandem.gateway.fields import field, shown, token_ids


def embed_request(body: dict[str, Any], limits: BodyLimits) -> EmbedCall:
    """POST /v1/embeddings -> one Embed call per input (mean-pooled unless `tandem_pooling` is "none")."""
    max_ids = limits.max_positions
    items = body.get("input")
    is_list = not (isinstance(items, str) or token_ids(items, "input", max_ids) is not None)
    if not is_list:
        items = [items]
    if not isinstance(items, list) or not items:
        raise InvalidArgument("input", "must be a string, a list of strings, or token IDs")
    at_most("input", len(items), MAX_INPUTS, "inputs")
    num_images = sum(isinstance(item, dict) and item.get("type") == "tandem_image" for item in items)
    at_most("input", num_images, MAX_IMAGES, "tandem_image inputs (pictures, as a chat's image_url parts)")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise InvalidArgument("encoding_format", f"must be float or base64, got {shown(encoding)}")
    if body.get("dimensions") is not None:
        raise InvalidArgument("dimensions", "is not supported: rows have the decoder's hidden size")
    pooling = body.get("tandem_pooling", "mean")
    if pooling not in ("mean", "none"):
        raise InvalidArgument("tandem_pooling", f"must be mean or none, got {shown(pooling)}")
    if pooling == "none" and encoding != "base64":
        # Every row as JSON floats is about 20 bytes a value: 64 inputs of rows could make gigabytes.
        raise InvalidArgument("encoding_format", 'must be "base64" with "tandem_pooling": "none"')
    model = field(body, "model", str) or ""
    field(body, "user", str)  # OpenAI's end-user ID: read by no one here, but of its type
    requests = []
    for i, item in enumerate(items):
        request = encoder_pb2.EmbedRequest(
            model=model,
            output_dtype=tensor_pb2.DATA_TYPE_FLOAT32,
            pooling=encoder_pb2.POOLING_MEAN if pooling == "mean" else encoder_pb2.POOLING_NONE,
        )
        if isinstance(item, str):
            request.text = item
        elif (ids := token_ids(item, f"input[{i}]", max_ids)) is not None:
            request.token_ids.ids.extend(ids)
        elif (
            isinstance(item, dict)
            and item.get("type") == "tandem_image"
            and isinstance(item.get("data"), str)
        ):
            try:
                request.image.data = base64.b64decode(item["data"], validate=True)
            except (binascii.Error, ValueError):
                raise InvalidArgument(f"input[{i}].data", "is not valid base64") from None
        else:
            raise InvalidArgument(f"input[{i}]", "must be a string, token IDs or a tandem_image part")
        requests.append(request)
    return EmbedCall(tuple(requests), model, encoding == "base64", is_list)
