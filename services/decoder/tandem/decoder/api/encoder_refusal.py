"""An encoder's refusal of an encoder part's input, as the decoder's refusal of the part.

The encoder is another server, and what its status says goes on to the decoder's caller (and the
gateway's 400 or 429) only where it is one of the encoder's own: a peer's status is checked as a caller's
request is.
- Its BadRequest field goes on under the part's (`prompt[2].encoder.image.data`) only where it is a field
  of EncoderInput, walked through its descriptor (`image.data`, `text`, `token_ids.ids[3]`): checked on
  its first segment alone, `image.data/../../etc/passwd`, NUL and ESC bytes and 10 KB paths went on, and
  `text.sampling.temperature`, which the gateway renamed as the decoder's own field (`text.temperature`).
- Its ErrorInfo goes on only in the encoder's domain, for a reason it gives, with that reason's keys: as
  it came, one claiming the decoder's PROMPT_LOGPROB_BUDGET made the gateway answer 400 on
  `prompt_logprobs` for an encoder that was full.
"""

from __future__ import annotations

import re

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from tandem.client import error_reasons as reasons
from tandem.client.errors import ErrorInfo, FailedPrecondition, InvalidArgument, TandemError
from tandem.client.pb.tandem.v1 import encoder_pb2
from tandem.client.status_details import StatusDetails

# A field path as Tandem's services write them: names and indices, nothing else.
FIELD_PATH = re.compile(r"[a-z_]+(?:\.[a-z_]+|\[\d{1,9}\])*")
MAX_FIELD_CHARS = 128  # EncoderInput's longest path is 16 (`token_ids.ids[3]`)


def refused(code: grpc.StatusCode, field: str, details: str, said: StatusDetails) -> TandemError:
    """The encoder's refusal of the part's input (INVALID_ARGUMENT or FAILED_PRECONDITION) as one of the
    part on `field`: its BadRequest field, where it is one of the input's (`is_input_field`), under the
    part's, as the message names it; a field the decoder set (`output_dtype`), none, or one that is no
    input's: the part's, the encoder's message after it. Its ErrorInfo where `passed_on` keeps it."""
    kind = InvalidArgument if code == grpc.StatusCode.INVALID_ARGUMENT else FailedPrecondition
    info = passed_on(said.info)
    if said.field_violations:
        inner, description = said.field_violations[0]
        if is_input_field(inner):
            return kind(f"{field}.{inner}", f"the encoder refused it: {description}", info=info)
    return kind(field, f"the encoder refused it: {details}", info=info)


def is_input_field(path: str) -> bool:
    """Whether `path` names a field of EncoderInput, or within one: each name a field of the message
    before it, an index only after a repeated field (and needed before a repeated message's fields)."""
    if len(path) > MAX_FIELD_CHARS or FIELD_PATH.fullmatch(path) is None:
        return False
    message: Descriptor | None = encoder_pb2.EncoderInput.DESCRIPTOR
    field: FieldDescriptor | None = None  # the field the path has named last, unindexed
    for token in re.findall(r"[a-z_]+|\[\d+\]", path):
        if token.startswith("["):
            if field is None or not field.is_repeated:
                return False
            message, field = field.message_type, None  # an element: its fields, if a message
        else:
            if message is None or (field is not None and field.is_repeated):
                return False
            field = message.fields_by_name.get(token)
            if field is None:
                return False
            message = field.message_type
    return True


def passed_on(info: ErrorInfo | None) -> ErrorInfo | None:
    """What of the encoder's ErrorInfo the decoder passes on: one in the encoder's domain for a reason
    it gives (`error_reasons.ENCODER_REASONS`), with that reason's keys alone; else none."""
    if info is None or info.domain != reasons.ENCODER or info.reason not in reasons.ENCODER_REASONS:
        return None
    keys = reasons.ENCODER_REASONS[info.reason]
    return ErrorInfo(
        info.reason, info.domain, {key: value for key, value in info.metadata.items() if key in keys}
    )
