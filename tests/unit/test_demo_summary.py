"""The line `make demo` ends each answer with: the time to the first token, then the rate after it, both
from the server's clock, so a short answer's rate is not its prompt's prefill."""

from __future__ import annotations

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.demo import summary


def _finished(num_tokens: int, time_to_first_token_s: float, total_time_s: float) -> decoder_pb2.Finished:
    finished = decoder_pb2.Finished(
        reason=decoder_pb2.FINISH_REASON_EOS,
        time_to_first_token_s=time_to_first_token_s,
        total_time_s=total_time_s,
    )
    finished.usage.input_tokens = 42
    finished.usage.output_tokens = num_tokens
    return finished


def test_the_rate_counts_the_tokens_after_the_first_over_the_time_after_it() -> None:
    # 8 tokens: the first after 1 s of prefill, the 7 others in 0.5 s (14 tokens/s, not 8 / 1.5 s).
    assert summary(_finished(8, 1.0, 1.5)) == (
        "FINISH_REASON_EOS, 42 prompt positions, 8 tokens, time to first token 1000.0 ms, then 14.0 tokens/s"
    )


def test_an_answer_of_one_token_has_no_rate_after_it() -> None:
    assert summary(_finished(1, 0.25, 0.25)) == (
        "FINISH_REASON_EOS, 42 prompt positions, 1 tokens, time to first token 250.0 ms"
    )
