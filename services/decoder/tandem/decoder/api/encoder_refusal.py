"""An encoder's refusal of an encoder part's input, as the decoder's refusal of the part.

The encoder is another server, and what its status says goes on to the decoder's caller (and the
gateway's 400 or 429) only where it is one of the encoder's own: a peer's status is checked as a caller's
request is.
- Its BadRequest field goes on under the part's (`prompt[2].encoder.image.data`) only where it is a field of
  EncoderInput, walked through its descriptor (`image.data`, `text`, `token_ids.ids[3]`), of the input the
  part sent (an index's form is checked, not whether the part has that many): checked on its first segment
  alone, `image.data/../../etc/passwd`, NUL and ESC bytes and 10 KB paths went on, and
  `text.sampling.temperature`, which the gateway renamed as the decoder's own field (`text.temperature`);
  `text` and `token_ids.ids[999999999]` of an image part went on too, and `token_ids.ids[٣]` (any Unicode
  digit, ASCII indices alone now).
- Its ErrorInfo goes on only in the encoder's domain, for a reason it gives, with that reason's keys and
  decimal values, and only with RESOURCE_EXHAUSTED (`passed_on`; the encoder's reasons are all of that
  code): as it came, one claiming the decoder's PROMPT_LOGPROB_BUDGET made the gateway answer 400 on
  `prompt_logprobs` for an encoder that was full, and a 400 carrying CALL_LIMIT read as a retryable
  call limit to a caller branching on the reason, as API.md asks.
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
FIELD_PATH = re.compile(r"[a-z_]+(?:\.[a-z_]+|\[[0-9]{1,9}\])*")
MAX_FIELD_CHARS = 128  # EncoderInput's longest path is 16 (`token_ids.ids[3]`)
# A value of one of the encoder's reasons' keys (`maxCalls`): a uint64, in decimal.
DECIMAL = re.compile(r"[0-9]{1,20}")


def refused(
    code: grpc.StatusCode, field: str, sent: str | None, details: str, said: StatusDetails
) -> TandemError:
    """The encoder's refusal of the part's input (INVALID_ARGUMENT or FAILED_PRECONDITION) as one of the
    part on `field`, which sent the input `sent` (EncoderInput's case: `image`; None: the call sent
    none): its BadRequest field, where it is within that input (`is_input_field`), under the part's, as
    the message names it; a field the decoder set (`output_dtype`), none, or one that is not: the
    part's, the encoder's message after it. No ErrorInfo: the encoder gives its reasons with
    RESOURCE_EXHAUSTED alone (`passed_on`)."""
    kind = InvalidArgument if code == grpc.StatusCode.INVALID_ARGUMENT else FailedPrecondition
    if said.field_violations and sent is not None:
        inner, description = said.field_violations[0]
        if is_input_field(inner, sent):
            return kind(f"{field}.{inner}", f"the encoder refused it: {description}")
    return kind(field, f"the encoder refused it: {details}")


def is_input_field(path: str, sent: str) -> bool:
    """Whether `path` names the field `sent` of EncoderInput (the input a part sent: a field of another
    case of its oneof names nothing the caller sent), or one within it: each name a field of the message
    before it, an index only after a repeated field (and needed before a repeated message's fields)."""
    if len(path) > MAX_FIELD_CHARS or FIELD_PATH.fullmatch(path) is None:
        return False
    tokens = re.findall(r"[a-z_]+|\[[0-9]+\]", path)
    if tokens[0] != sent:
        return False
    message: Descriptor | None = encoder_pb2.EncoderInput.DESCRIPTOR
    field: FieldDescriptor | None = None  # the field the path has named last, unindexed
    for token in tokens:
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
    """What of the encoder's RESOURCE_EXHAUSTED ErrorInfo the decoder passes on: one in the encoder's
    domain for a reason it gives (`error_reasons.ENCODER_REASONS`), with that reason's keys alone, each
    where its value is a number (`maxCalls`: 'x' * 128 went on); else none."""
    if info is None or info.domain != reasons.ENCODER or info.reason not in reasons.ENCODER_REASONS:
        return None
    keys = reasons.ENCODER_REASONS[info.reason]
    return ErrorInfo(
        info.reason,
        info.domain,
        {key: value for key, value in info.metadata.items() if key in keys and DECIMAL.fullmatch(value)},
    )
