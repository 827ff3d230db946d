"""An Embed call as the embedder takes it, and its input validated and tokenized into an EmbedJob.

The servicer converts the proto into an EmbedSpec (conversion only: what fails there is an enum it
cannot map). `build_job` checks every rule, once, cheapest first, with errors that name the request
field: the request id; an input set and not empty; text that cannot fit refused from its length
before it is tokenized (tokenizing 30 MB took 27 s and 4 GB it never gave back); then the
positions against max_input_tokens, the IDs against the vocabulary and the reply's size against
max_message_bytes. The rules on the input are `tandem/common/prompt_parts.py`'s, the decoder's as well.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.client.errors import InvalidArgument
from tandem.common.prompt_parts import TextPrompt, check_part, check_token_ids, num_positions_at_least
from tandem.common.text_bounds import check_fits
from tandem.common.wire_limits import check_request_id
from tandem.encoder.embedder import Embedder, Pooling

# Room in a response for everything but the tensor bytes: token IDs (up to 5 bytes each) and framing.
RESPONSE_OVERHEAD_BYTES = 4096
BYTES_PER_TOKEN_ID = 5


@dataclass(frozen=True)
class EmbedSpec:
    """One Embed call as the embedder takes it (the servicer converts the proto into this)."""

    input: TextPrompt | Sequence[int] | None  # token IDs as sent, not copied; None: neither was set
    add_special_tokens: bool = False  # text only: the tokenizer adds its BOS/EOS
    request_id: str = ""  # the caller's label, echoed in the reply; "" = a random one is assigned
    pooling: Pooling | None = None  # None: the server's configured pooling
    output_dtype: torch.dtype | None = None  # None: the embedder's native dtype


@dataclass(frozen=True)
class EmbedJob:
    """A valid Embed call: what the embedder runs and the reply echoes."""

    request_id: str  # never empty
    token_ids: list[int]  # [num_tokens], at least one, each in the embedder's vocabulary
    pooling: Pooling
    output_dtype: torch.dtype | None  # None: the embedder's native dtype


def build_job(
    spec: EmbedSpec,
    embedder: Embedder,
    max_input_tokens: int,  # min(the config's, the embedder's own limit)
    max_message_bytes: int,
    default_pooling: Pooling,
) -> EmbedJob:
    """Validate the spec against the embedder and tokenize its text. Raises InvalidArgument."""
    check_request_id(spec.request_id)
    if spec.input is None:
        raise InvalidArgument("input", "set exactly one of text or token_ids")
    info = embedder.info
    field = "text" if isinstance(spec.input, TextPrompt) else "token_ids"
    check_part(spec.input, "", info.hidden_size, accepts_embeddings=False)
    check_fits(
        num_positions_at_least([spec.input], info.max_token_chars),
        max_input_tokens,
        field,
        info.max_token_chars,
        f"max_input_tokens {max_input_tokens}",
    )
    if isinstance(spec.input, TextPrompt):
        token_ids = embedder.tokenize(spec.input.text, spec.add_special_tokens)
        if not token_ids:
            raise InvalidArgument("text", "produces no tokens; send text with at least one token")
        if len(token_ids) > max_input_tokens:
            raise InvalidArgument(
                "text", f"{len(token_ids)} positions exceed max_input_tokens {max_input_tokens}"
            )
    else:
        check_token_ids(spec.input, "token_ids.ids", info.vocab_size)
        token_ids = list(spec.input)
    pooling = spec.pooling or default_pooling
    num_rows = 1 if pooling is Pooling.MEAN else info.num_virtual_tokens + len(token_ids)
    itemsize = (spec.output_dtype or info.dtype).itemsize
    num_bytes = num_rows * info.hidden_size * itemsize + len(token_ids) * BYTES_PER_TOKEN_ID
    if num_bytes > max_message_bytes - RESPONSE_OVERHEAD_BYTES:
        raise InvalidArgument(
            field,
            f"the response would take about {num_bytes} bytes, over max_message_bytes "
            f"{max_message_bytes}; send a shorter input or a 2-byte output_dtype",
        )
    return EmbedJob(spec.request_id or uuid.uuid4().hex, token_ids, pooling, spec.output_dtype)
