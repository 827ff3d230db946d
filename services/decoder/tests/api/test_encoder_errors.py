"""The encoder's status as one part's error (`encoder_errors.py`), through a real gRPC channel and server:
the encoder's refusal of the input on the part's field with its details, an encoder full with its own
retry delay and reason, a message over either side's --max-message-bytes the caller's INVALID_ARGUMENT
naming whose, an encoder gRPC cannot reach said in fixed words and logged once in a while, and an
encoder's own UNAVAILABLE in its words. The encoder is the stand-in of encoder_stand_in.py."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import grpc
import pytest
import torch

from common.tests.ports import free_port
from tandem.client.errors import (
    ErrorInfo,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    TandemError,
    Unavailable,
)
from tandem.client.pb.tandem.v1 import encoder_pb2_grpc
from tandem.common.server import RunningServer, ServerOptions, Service, start_server
from tandem.common.torch_part.prompt_parts import EncoderPrompt, TextPrompt
from tandem.decoder.api import encoder_parts
from tandem.decoder.api.encoder_errors import EncoderErrors
from tandem.decoder.api.encoder_faults import unavailable
from tandem.decoder.api.encoder_parts import EncoderParts

from .encoder_stand_in import (
    HIDDEN_SIZE,
    PICTURE,
    StandIn,
    fetched_rows,
    picture,
    rows_of,
    start_fetches,
    until,
)

# Another server's reason: as it came, the gateway answered 400 on prompt_logprobs for an encoder full.
NOT_THE_ENCODERS = ErrorInfo("PROMPT_LOGPROB_BUDGET", "tandem.decoder", {"maxEntries": "1"})
ENCODERS_CALL_LIMIT = ErrorInfo("CALL_LIMIT", "tandem.encoder", {"maxCalls": "1"})


@pytest.mark.parametrize(
    ("encoders_delay_s", "passed_on_s"), [(3.5, 3.5), (None, 1.0), (-5.0, 1.0), (0.0, 1.0), (3e9, 1.0)]
)
async def test_an_encoder_full_is_passed_on_with_its_own_retry_delay_or_a_second_where_it_gave_none(
    encoder: StandIn,
    parts: EncoderParts,
    encoders_delay_s: float | None,
    passed_on_s: float,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The caller retries when the encoder said it has room: its RetryInfo was dropped, every one
    passed on as 1 s. An ErrorInfo not the encoder's own is not passed on. Which encoder was full is
    the operator's to read (WARNING), not the caller's: it named the encoder's internal address."""
    encoder.refusal = ResourceExhausted("no room", encoders_delay_s, info=NOT_THE_ENCODERS)
    encoder.gate.set()
    (part,), _ = start_fetches(parts, [picture()])
    with caplog.at_level(logging.WARNING, logger=encoder_parts.__name__):
        with pytest.raises(ResourceExhausted) as error:
            await fetched_rows(part)
    assert error.value.message == "prompt[0].encoder: the encoder is full: no room"
    assert (error.value.retry_after_s, error.value.info) == (passed_on_s, None)
    assert [r.getMessage() for r in caplog.records] == [
        f"an Embed call to encoder {parts.address} failed: RESOURCE_EXHAUSTED: no room"
    ]


@pytest.mark.parametrize(
    ("refusal", "field", "description"),
    [
        (  # a field of the part's input: named under the part, in its BadRequest as in its message
            InvalidArgument("image.data", "cannot be preprocessed", info=NOT_THE_ENCODERS),
            "prompt[1].encoder.image.data",
            "the encoder refused it: cannot be preprocessed",
        ),
        (
            FailedPrecondition("image", "this encoder takes no images", info=NOT_THE_ENCODERS),
            "prompt[1].encoder.image",
            "the encoder refused it: this encoder takes no images",
        ),
        (  # a field of an input the part did not send (it sent an image): the part's
            InvalidArgument("token_ids.ids[3]", "must be in [0, 49152)", info=NOT_THE_ENCODERS),
            "prompt[1].encoder",
            "the encoder refused it: token_ids.ids[3]: must be in [0, 49152)",
        ),
        (  # the encoder's own reason, but one of RESOURCE_EXHAUSTED: a 400 with it read as retryable
            InvalidArgument("image.data", "cannot be preprocessed", info=ENCODERS_CALL_LIMIT),
            "prompt[1].encoder.image.data",
            "the encoder refused it: cannot be preprocessed",
        ),
        (  # a field the decoder set, no field of the caller's: the part, the encoder's words after it
            InvalidArgument("output_dtype", "FLOAT64 is not served", info=NOT_THE_ENCODERS),
            "prompt[1].encoder",
            "the encoder refused it: output_dtype: FLOAT64 is not served",
        ),
        (  # shaped like the decoder's own field, which the gateway renames: the part's
            InvalidArgument("text.sampling.temperature", "bad", info=NOT_THE_ENCODERS),
            "prompt[1].encoder",
            "the encoder refused it: text.sampling.temperature: bad",
        ),
    ],
)
async def test_the_encoders_refusal_is_passed_on_with_its_details_its_field_under_the_parts(
    encoder: StandIn, parts: EncoderParts, refusal: TandemError, field: str, description: str
) -> None:
    # Its BadRequest field was dropped: the caller's field was the part's alone. Its ErrorInfo goes on only
    # where it is the encoder's own, with RESOURCE_EXHAUSTED (CALL_LIMIT: the test below).
    encoder.refusal = refusal
    encoder.gate.set()
    (part,), _ = start_fetches(parts, [TextPrompt("look:"), picture()])
    with pytest.raises(type(refusal)) as error:
        await fetched_rows(part)
    assert (error.value.field, error.value.description, error.value.info) == (field, description, None)


async def test_an_encoder_full_is_passed_on_with_its_error_info(tmp_path) -> None:
    """Its bound on calls at once (CALL_LIMIT, in the encoder's domain) says so through the decoder."""
    servicer = StandIn()
    server = await start_server(
        ServerOptions(host="127.0.0.1", port=0, max_concurrent_rpcs=1),
        [Service("tandem.v1.Encoder", servicer, encoder_pb2_grpc.add_EncoderServicer_to_server)],
    )
    parts = EncoderParts(
        server.address, torch.float32, 1 << 20, cache_bytes=1 << 20, shm_dir=tmp_path, hidden_size=HIDDEN_SIZE
    )
    try:
        (held,), _ = start_fetches(parts, [picture()])  # its Embed call holds the encoder's one place
        await until(lambda: servicer.num_embeds == 1)
        (part,), _ = start_fetches(parts, [EncoderPrompt("image", b"another picture")])
        with pytest.raises(ResourceExhausted) as error:
            await fetched_rows(part)
        assert "this server runs at most 1 calls at once" in error.value.message
        assert error.value.info == ENCODERS_CALL_LIMIT
        assert error.value.retry_after_s == 1.0
        servicer.gate.set()
        assert torch.equal(await fetched_rows(held), rows_of(PICTURE))
    finally:
        await parts.close()
        await server.stop(0)


async def test_rows_over_the_decoders_message_cap_sent_as_bytes_are_the_callers_invalid_argument(
    encoder: StandIn, stand_in: tuple[StandIn, RunningServer], tmp_path
) -> None:
    """gRPC refuses a reply over this decoder's --max-message-bytes as RESOURCE_EXHAUSTED, which read
    "encoder ... is full" with a RetryInfo: no retry mends a long input. Through shared memory the same
    rows were already INVALID_ARGUMENT on the caller's field."""
    parts = EncoderParts(stand_in[1].address, torch.float32, 64 * 1024, cache_bytes=0, shm_dir=tmp_path)
    try:
        encoder.gate.set()
        encoder.rows = torch.ones(4096, HIDDEN_SIZE)  # 128 KiB of rows
        [part], _ = start_fetches(parts, [TextPrompt("look:"), picture()])
        with pytest.raises(InvalidArgument) as error:
            await fetched_rows(part)
    finally:
        await parts.close()
    assert error.value.field == "prompt[1].encoder"
    assert error.value.description == (
        "the encoder's rows are larger than this decoder's --max-message-bytes 65536 allows (a reply of "
        "131087 bytes): send a shorter input, or start the decoder with a larger --max-message-bytes"
    )


async def test_an_embed_request_over_the_decoders_message_cap_is_the_callers_invalid_argument(
    encoder: StandIn, stand_in: tuple[StandIn, RunningServer], tmp_path
) -> None:
    """A picture just under --max-message-bytes fits its Generate call, and its Embed call, a few
    hundred bytes larger, does not: gRPC refused it as RESOURCE_EXHAUSTED "encoder ... is full"."""
    parts = EncoderParts(stand_in[1].address, torch.float32, 64 * 1024, cache_bytes=0, shm_dir=tmp_path)
    try:
        [part], _ = start_fetches(parts, [EncoderPrompt("image", b"p" * (64 * 1024 - 40))])
        with pytest.raises(InvalidArgument) as error:
            await fetched_rows(part)
    finally:
        await parts.close()
    assert error.value.field == "prompt[0].encoder"
    assert re.fullmatch(
        r"its Embed request of \d+ bytes \(the input and the call's own fields\) is larger than this "
        r"decoder's --max-message-bytes 65536 allows: send a smaller input, or start the decoder with a "
        r"larger --max-message-bytes",
        error.value.description,
    )
    assert encoder.num_embeds == 0


@pytest.mark.parametrize(
    ("picture", "rows", "description"),
    [
        (
            b"p" * 40_000,
            None,
            r"its Embed request of \d+ bytes is larger than the encoder's --max-message-bytes 32768 allows",
        ),
        (
            PICTURE,
            torch.ones(1200, HIDDEN_SIZE),  # 37.5 KiB of rows
            r"its rows are larger than the encoder's own --max-message-bytes 32768 allows \(a reply of "
            r"\d+ bytes\)",
        ),
    ],
    ids=["request", "reply"],
)
async def test_a_message_over_the_encoders_own_cap_is_the_callers_invalid_argument_naming_the_encoders(
    picture: bytes, rows: torch.Tensor | None, description: str, tmp_path
) -> None:
    """An encoder with a smaller --max-message-bytes than the decoder's: gRPC refuses the request or
    the reply at the encoder, RESOURCE_EXHAUSTED "SERVER: ... message larger than max", which read
    "encoder ... is full" (a reply grew past it with an encoder's --model-name of 3.5 KB)."""
    servicer = StandIn()
    servicer.gate.set()
    servicer.rows = rows
    server = await start_server(
        ServerOptions(host="127.0.0.1", port=0, max_message_bytes=32 * 1024),
        [Service("tandem.v1.Encoder", servicer, encoder_pb2_grpc.add_EncoderServicer_to_server)],
    )
    await server.set_serving()
    parts = EncoderParts(server.address, torch.float32, 64 * 1024, cache_bytes=0, shm_dir=tmp_path)
    try:
        [part], _ = start_fetches(parts, [EncoderPrompt("image", picture)])
        with pytest.raises(InvalidArgument) as error:
            await fetched_rows(part)
    finally:
        await parts.close()
        await server.stop(0)
    assert error.value.field == "prompt[0].encoder"
    assert re.fullmatch(
        description + ": send a smaller input, or start the encoder with a larger --max-message-bytes",
        error.value.description,
    )


def _parts_of_no_encoder(tmp_path: Path) -> tuple[str, EncoderParts]:
    """An address nothing listens on (a port of this worker's slice, free now), and parts asking it."""
    address = f"127.0.0.1:{free_port()}"
    return address, EncoderParts(
        address, torch.float32, 1 << 20, cache_bytes=0, shm_dir=tmp_path, hidden_size=HIDDEN_SIZE
    )


async def test_an_encoder_gRPC_cannot_reach_is_said_in_fixed_words_and_gRPCs_are_logged(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """gRPC's own UNAVAILABLE (no status of the encoder's) went on as "is unavailable (UNAVAILABLE:
    failed to connect to all addresses; last error: ... ipv4:10.0.0.3:50051 ...)", gRPC's terms and
    the internal address, which the gateway passes on to HTTP callers unchanged (it carries the
    decoder's status); then as "encoder 10.0.0.3:50051 could not be reached", the address still in it.
    The caller gets the part and what happened; the operator gets the address and gRPC's words."""
    address, parts = _parts_of_no_encoder(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger=encoder_parts.__name__):
            [part], _ = start_fetches(parts, [picture()])
            with pytest.raises(Unavailable) as error:
                await asyncio.wait_for(asyncio.wrap_future(part.rows), 30)
    finally:
        await parts.close()
    assert str(error.value) == (
        "prompt[0].encoder: the encoder could not be reached (no connection, or it was lost); retry"
    )
    [record] = caplog.records
    assert record.levelname == "WARNING"
    assert record.getMessage().startswith(f"an Embed call to encoder {address} failed: UNAVAILABLE: ")


async def test_a_request_of_five_parts_with_no_encoder_listening_logs_one_warning_line(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """`_error` runs once for each part waiting on a failed call: a stopped encoder wrote one identical
    WARNING line per part, N for a request of N parts. gRPC's own failures are logged once in a while
    for each encoder and code, as the gateway logs them."""
    address, parts = _parts_of_no_encoder(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger=encoder_parts.__name__):
            five, _ = start_fetches(parts, [EncoderPrompt("image", f"p{i}".encode()) for i in range(5)])
            for part in five:
                with pytest.raises(Unavailable, match="could not be reached"):
                    await asyncio.wait_for(asyncio.wrap_future(part.rows), 30)
    finally:
        await parts.close()
    assert len(five) == 5
    assert [r.getMessage().split(": UNAVAILABLE: ")[0] for r in caplog.records] == [
        f"an Embed call to encoder {address} failed"
    ]


async def test_an_encoders_own_unavailable_keeps_its_words(
    encoder: StandIn, parts: EncoderParts, caplog: pytest.LogCaptureFixture
) -> None:
    """An UNAVAILABLE the encoder sent (its status with it: still loading, shutting down) is its own
    word on why, passed on as it said it; which encoder said it is the operator's to read (WARNING)."""
    encoder.refusal = Unavailable("the encoder is still loading its model")
    encoder.gate.set()
    [part], _ = start_fetches(parts, [picture()])
    with caplog.at_level(logging.WARNING, logger=encoder_parts.__name__):
        with pytest.raises(Unavailable) as error:
            await fetched_rows(part)
    assert str(error.value) == (
        "prompt[0].encoder: the encoder is unavailable (UNAVAILABLE: the encoder is still loading its model)"
    )
    said = "UNAVAILABLE: the encoder is still loading its model"
    assert [r.getMessage() for r in caplog.records] == [
        f"an Embed call to encoder {parts.address} failed: {said}"
    ]


def test_a_faulty_reply_is_logged_though_the_encoder_was_unreachable_a_moment_before() -> None:
    """Each kind of failure is logged once in a while on its own: a reply this decoder found wrong in
    itself, right after gRPC could not reach that encoder, is a line of its own, not one of the
    unreachable's counted. Neither caller's error names the encoder."""
    logged: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    log = logging.getLogger("test_encoder_errors.kinds")
    log.addHandler(Lines())
    errors = EncoderErrors("10.0.0.5:50052", 1 << 20, log)
    no_connection = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "ipv4:10.0.0.5:50052: refused"
    )
    faulty = unavailable("its reply's .embeddings.shape: expected rank 2, got rank 1: [8]", None)
    said = [
        str(errors.named(no_connection, "prompt[0].encoder")),
        str(errors.named(faulty, "prompt[1].encoder")),
    ]
    assert said == [
        "prompt[0].encoder: the encoder could not be reached (no connection, or it was lost); retry",
        "prompt[1].encoder: the encoder is unavailable "
        "(UNAVAILABLE: its reply's .embeddings.shape: expected rank 2, got rank 1: [8])",
    ]
    assert logged == [
        "an Embed call to encoder 10.0.0.5:50052 failed: UNAVAILABLE: ipv4:10.0.0.5:50052: refused",
        "an Embed call to encoder 10.0.0.5:50052 failed: UNAVAILABLE: its reply's .embeddings.shape: "
        "expected rank 2, got rank 1: [8]",
    ]
