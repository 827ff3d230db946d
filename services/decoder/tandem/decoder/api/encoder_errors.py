"""The encoder's status as one part's error, for `encoder_parts.py`: the encoder's refusal of the input on
the part's field, an input too long for a message, an encoder full or unreachable, each naming the replica
that took the call. A fetch's own time running out is the fetch's to name (`EncoderParts._out_of_time`).

Its own module, apart from the fetching: a failed Embed call shared by several parts is named once for
each, on its own field, and gRPC's own failures among them are logged once in a while, not once a part.
"""

from __future__ import annotations

import logging

import grpc

from tandem.client.errors import InvalidArgument, ResourceExhausted, TandemError, Unavailable
from tandem.client.grpc_failures import GrpcsOwnWarnings
from tandem.client.over_cap import over_cap
from tandem.client.status_details import status_details
from tandem.decoder.api.encoder_faults import encoder_named, is_grpcs_own
from tandem.decoder.api.encoder_over_cap import description
from tandem.decoder.api.encoder_refusal import passed_on, refused

ENCODER_FULL_RETRY_S = 1.0  # an encoder's RESOURCE_EXHAUSTED with no RetryInfo of its own, passed on
ENCODER_MAX_RETRY_S = 60.0  # an encoder's delay past this (or not above 0) is passed on as the 1 s


class EncoderErrors:
    def __init__(self, address: str, max_message_bytes: int, log: logging.Logger) -> None:
        self.address = address
        self.max_message_bytes = max_message_bytes
        # gRPC's own failures of Embed calls, logged once in a while for each encoder and code: `named`
        # runs once for each part waiting on a failed call, so a stopped encoder wrote one line per part.
        self._grpcs_own_warnings = GrpcsOwnWarnings(log)

    def named(self, error: grpc.aio.AioRpcError, field: str, sent: str | None = None) -> TandemError:
        """The encoder's status as this call's: about the input the call sent (`sent`, EncoderInput's
        case; None: it sent none), or about the encoder. The encoder's details go on with it where they
        are the encoder's own (its ErrorInfo when full, its RetryInfo bounded, its BadRequest field within
        `sent` under the part's: `encoder_refusal.py`): they were dropped, the field left in the message
        alone. DEADLINE_EXCEEDED is not this method's: whose time ran out is the fetch's to say."""
        code, details = error.code(), error.details() or ""
        who = encoder_named(self.address, error)
        said = status_details(error)
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            return refused(code, field, sent, details, said)
        if (over := over_cap(error)) is not None:
            # The caller's input is too long, and no retry mends that. It was RESOURCE_EXHAUSTED
            # "encoder ... is full", with a RetryInfo, where the same rows through shared memory were
            # INVALID_ARGUMENT.
            return InvalidArgument(field, description(over, self.max_message_bytes))
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # The encoder's RetryInfo is its own word on when it has room; it was dropped, every one
            # passed on as 1 s. One without (an encoder from before its bound on calls at once said one)
            # gets the 1 s the gateway waits for that bound.
            # Bounded as the gateway bounds a decoder's: a negative or huge delay is no advice to pass on.
            delay_s = said.retry_delay_s
            return ResourceExhausted(
                f"{field}: encoder {who} is full: {details}",
                ENCODER_FULL_RETRY_S
                if delay_s is None or not 0 < delay_s <= ENCODER_MAX_RETRY_S
                else delay_s,
                info=passed_on(said.info),
            )
        if code == grpc.StatusCode.UNAVAILABLE and is_grpcs_own(error):
            self._grpcs_own_warnings.warn(
                who, code, f"an Embed call to encoder {who} failed: UNAVAILABLE: {details}"
            )
            return Unavailable(f"{field}: encoder {who} could not be reached (no connection, or it was lost)")
        return Unavailable(f"{field}: encoder {who} is unavailable ({code.name}: {details})")
