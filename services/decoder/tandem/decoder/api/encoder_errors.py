"""The encoder's status as one part's error, for `encoder_parts.py`: the encoder's refusal of the input on
the part's field, an input too long for a message, an encoder full or unreachable. A fetch's own time
running out is the fetch's to name (`EncoderParts._out_of_time`).

The caller's error names the part's field and what happened, never the encoder's address: the gateway
passes a decoder's own status on to HTTP callers, and "image[0]: encoder 10.0.0.5:50052 could not be
reached" showed this deployment's internal addresses to whoever called. The operator's WARNING line names
the encoder (the replica that took the call, where it said: `encoder_named`) with its own words or gRPC's.

Its own module, apart from the fetching: a failed Embed call shared by several parts is named once for
each, on its own field, and logged once in a while for each kind of failure, encoder and code, not once a
part.
"""

from __future__ import annotations

import enum
import logging

import grpc

from tandem.client.errors import InvalidArgument, ResourceExhausted, TandemError, Unavailable
from tandem.client.grpc_failures import GrpcsOwnWarnings
from tandem.client.over_cap import over_cap
from tandem.client.status_details import status_details
from tandem.decoder.api.encoder_faults import FaultyReply, encoder_named, is_grpcs_own
from tandem.decoder.api.encoder_over_cap import description
from tandem.decoder.api.encoder_refusal import passed_on, refused

ENCODER_FULL_RETRY_S = 1.0  # an encoder's RESOURCE_EXHAUSTED with no RetryInfo of its own, passed on
ENCODER_MAX_RETRY_S = 60.0  # an encoder's delay past this (or not above 0) is passed on as the 1 s


class Failure(enum.Enum):
    """What befell an encoder part's call, for its WARNING line. Each is logged once in a while on its
    own: an unreachable encoder's lines do not hold back one saying its reply was wrong."""

    UNREACHABLE = "gRPC's own: no connection, or it was lost"
    SILENT = "no answer within the fetch's time"
    REFUSED = "the encoder's own status: full, unavailable, failed"
    FAULTY = "a reply this decoder found wrong in itself"
    NO_PLACE = "this decoder's limit of Embed calls in flight"
    OTHER_MODEL = "an encoder serving another model than this decoder's"


class EncoderErrors:
    def __init__(self, address: str, max_message_bytes: int, log: logging.Logger) -> None:
        self.address = address
        self.max_message_bytes = max_message_bytes
        # Each kind of failure logged once in a while for each encoder and code: `named` runs once for
        # each part waiting on a failed call, so a stopped encoder wrote one line per part.
        self._warnings = {failure: GrpcsOwnWarnings(log) for failure in Failure}

    def warn(self, failure: Failure, who: str, code: grpc.StatusCode, line: str) -> None:
        """Logs `line` (naming the encoder `who`, which the caller's error does not) at WARNING, unless
        one of this `failure`, encoder and `code` was logged less than WARN_EVERY_S (10 s) ago."""
        self._warnings[failure].warn(who, code, line)

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
            self.warn(
                Failure.REFUSED, who, code, f"an Embed call to encoder {who} failed: {code.name}: {details}"
            )
            return ResourceExhausted(
                f"{field}: the encoder is full: {details}",
                ENCODER_FULL_RETRY_S
                if delay_s is None or not 0 < delay_s <= ENCODER_MAX_RETRY_S
                else delay_s,
                info=passed_on(said.info),
            )
        if code == grpc.StatusCode.UNAVAILABLE and is_grpcs_own(error):
            # gRPC's own words name the encoder's address and port in its terms: the operator's alone.
            self.warn(
                Failure.UNREACHABLE,
                who,
                code,
                f"an Embed call to encoder {who} failed: UNAVAILABLE: {details}",
            )
            return Unavailable(
                f"{field}: the encoder could not be reached (no connection, or it was lost); retry"
            )
        # The encoder's own words (still loading, shutting down), or this decoder's on a faulty reply: the
        # caller's to read, as they are.
        failure = Failure.FAULTY if isinstance(error, FaultyReply) else Failure.REFUSED
        self.warn(failure, who, code, f"an Embed call to encoder {who} failed: {code.name}: {details}")
        return Unavailable(f"{field}: the encoder is unavailable ({code.name}: {details})")
