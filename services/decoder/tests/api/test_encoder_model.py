"""Which model the encoder serves (`encoder_model.py`), asked at the first encoder part where the
encoder did not answer at start: parts asking at once share one GetModelInfo call, each answered at its
own time. The encoder is the stand-in of encoder_stand_in.py. (The samples compared: test_encoder_model_
check.py; the check between real services: tests/integration/encoder/
test_decoder_checks_the_encoders_model.py.)"""

from __future__ import annotations

import asyncio

import pytest

from tandem.client.errors import DeadlineExceeded, Unavailable
from tandem.common.torch_part.prompt_parts import EncoderPrompt
from tandem.decoder.api import encoder_parts
from tandem.decoder.api.encoder_parts import EncoderParts

from .encoder_stand_in import StandIn, fetched_rows, start_fetches, until

CAP_S = 0.5  # MAX_FETCH_S here: a whole cap of slack on the bound below, for a loaded host


async def test_parts_asking_a_silent_encoder_its_model_share_one_call_and_each_answers_at_its_own_time(
    encoder: StandIn, parts: EncoderParts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An encoder that did not answer at start-up is asked its model's name at the first part. Each
    part asked in turn under a lock held for the whole call, with its time counted from before it
    waited: with a hung encoder the k-th of 4 parts answered at k times the cap (60 s each)."""
    monkeypatch.setattr(encoder_parts, "MAX_FETCH_S", CAP_S)
    encoder.is_info_hung = True
    loop = asyncio.get_running_loop()
    started = loop.time()
    unbounded = [start_fetches(parts, [EncoderPrompt("image", bytes([i]))])[0][0] for i in range(4)]
    [hurried], _ = start_fetches(parts, [EncoderPrompt("image", b"hurried")], time_remaining_s=0.1)
    answers: list[tuple[bytes, str, float]] = []  # each part's content, error and time, as they came

    async def answered(part: EncoderPrompt) -> None:
        with pytest.raises((Unavailable, DeadlineExceeded)) as error:
            await fetched_rows(part)
        answers.append((part.content, str(error.value), loop.time() - started))

    await asyncio.gather(*map(answered, [*unbounded, hurried]))
    (first, hurried_error, _), *silent = answers
    # At its own 0.1 s: not when the call it joined, started by a part with the whole cap, ran out.
    assert first == b"hurried"
    assert hurried_error == (
        "prompt[0].encoder: the deadline passed while the encoder asked which model it serves"
    )
    for _, error, answered_s in silent:
        assert error == f"prompt[0].encoder: the encoder did not answer within {CAP_S:g} s; retry"
        # Parts asking in turn answer the second at two caps or later however idle the host is; these
        # answer at one cap, with a whole cap to spare for a loaded one.
        assert answered_s < 2 * CAP_S
    assert encoder.num_infos == 1
    await until(lambda: encoder.num_infos_cancelled == 1)  # nobody waits for it: not left running
