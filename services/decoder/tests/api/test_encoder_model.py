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


async def test_parts_asking_a_silent_encoder_its_model_share_one_call_and_each_answers_at_its_own_time(
    encoder: StandIn, parts: EncoderParts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An encoder that did not answer at start-up is asked its model's name at the first part. Each
    part asked in turn under a lock held for the whole call, with its time counted from before it
    waited: with a hung encoder the k-th of 4 parts answered at 4 times the cap (60 s each)."""
    monkeypatch.setattr(encoder_parts, "MAX_FETCH_S", 0.3)
    encoder.is_info_hung = True
    loop = asyncio.get_running_loop()
    started = loop.time()
    unbounded = [start_fetches(parts, [EncoderPrompt("image", bytes([i]))])[0][0] for i in range(4)]
    [hurried], _ = start_fetches(parts, [EncoderPrompt("image", b"hurried")], time_remaining_s=0.1)

    async def answered(part: EncoderPrompt) -> tuple[str, float]:
        with pytest.raises((Unavailable, DeadlineExceeded)) as error:
            await fetched_rows(part)
        return str(error.value), loop.time() - started

    *silent, (hurried_error, hurried_s) = await asyncio.gather(*map(answered, [*unbounded, hurried]))
    assert hurried_error == (
        f"prompt[0].encoder: the deadline passed while encoder {parts.address} asked which model it serves"
    )
    assert hurried_s < 0.25
    for error, answered_s in silent:
        assert error == f"prompt[0].encoder: encoder {parts.address} did not answer within 0.3 s"
        assert answered_s < 0.55
    assert encoder.num_infos == 1
    await until(lambda: encoder.num_infos_cancelled == 1)  # nobody waits for it: not left running
