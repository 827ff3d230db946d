"""A request's choices: each prompt asked `n` times, each time a Generate call of its own.

NOTE: numbering and seeds. Choice j of prompt i has index i * n + j, as OpenAI and vLLM number a
batch's choices. With a `seed`, choice j of every prompt is seeded seed + j (modulo 2**64), the rule
vLLM follows for its parallel samples: the choices differ from one another, the same body gives the
same choices again, and choice 0 is the answer the body gives with n = 1. Without a seed each choice
draws from the decoder's own generator. Greedy choices (temperature 0) are all the same answer.

Prompt logprobs (`prompt_logprobs`) are the prompt's, the same for each of its choices: only choice 0
of each prompt asks for them, as scoring a prompt runs all of its prefill past the prefix cache and
holds positions x (1 + N) entries of the caller's budget in the decoder; the answer gives them to the
prompt's other choices (`responses.share_scores`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.calls import GenerateCall

SEEDS = 2**64  # the proto's uint64 seed


@dataclass(frozen=True)
class Choice:
    """One choice of a request: where it goes in the answer and the call that makes it."""

    index: int  # OpenAI's choice `index`: prompt_index * n + j
    prompt_index: int  # which of the body's prompts it answers (0 unless a batch)
    request: decoder_pb2.GenerateRequest  # its own Generate call (its seed, its request ID)


def choices_of(call: GenerateCall, request_id: str) -> list[Choice]:
    """Every choice of `call`, in index order. The decoder's request IDs are `request_id` for a lone
    choice, else `request_id-index`, so that each stream can be told apart in its logs and traces."""
    choices = []
    for i, prompt in enumerate(call.requests):
        for j in range(call.n):
            index = i * call.n + j
            if call.num_choices == 1:
                request = prompt  # the one call: no copy of a prompt that may be megabytes of rows
            else:
                request = decoder_pb2.GenerateRequest()
                request.CopyFrom(prompt)
                if request.sampling.HasField("seed"):
                    request.sampling.seed = (request.sampling.seed + j) % SEEDS
                if j:  # the prompt's scores are every choice's: choice 0 asks (the NOTE)
                    request.output.ClearField("prompt_logprobs")
            request.request_id = request_id if call.num_choices == 1 else f"{request_id}-{index}"
            choices.append(Choice(index, i, request))
    return choices
