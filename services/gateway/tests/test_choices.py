"""A request's choices: prompt i's choice j is index i * n + j, and with a seed it is seeded seed + j,
so the choices differ and the same body gives them again; a lone choice is its request itself."""

from __future__ import annotations

from tandem.gateway.body_limits import BodyLimits
from tandem.gateway.choices import choices_of
from tandem.gateway.completion_request import completion_request

LIMITS = BodyLimits.for_completions(256, 16)


def _choices(body: dict) -> list:
    return choices_of(completion_request(body, LIMITS), "r")


def test_a_batchs_choices_are_numbered_prompt_by_prompt_as_openai_numbers_them() -> None:
    choices = _choices({"prompt": ["a", "b", "c"], "n": 2})
    assert [(c.index, c.prompt_index) for c in choices] == [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2), (5, 2)]
    assert [c.request.prompt[0].text for c in choices] == ["a", "a", "b", "b", "c", "c"]
    assert [c.request.request_id for c in choices] == [f"r-{i}" for i in range(6)]


def test_choice_j_of_every_prompt_is_seeded_seed_plus_j() -> None:
    choices = _choices({"prompt": [[1], [2]], "n": 3, "seed": 40})
    assert [c.request.sampling.seed for c in choices] == [40, 41, 42, 40, 41, 42]
    assert _choices({"prompt": [[1], [2]], "n": 3, "seed": 40}) == choices  # the same body, the same calls


def test_seeds_wrap_at_the_protos_uint64_and_unseeded_choices_stay_unseeded() -> None:
    wrapped = _choices({"prompt": "a", "n": 3, "seed": 2**64 - 2})
    assert [c.request.sampling.seed for c in wrapped] == [2**64 - 2, 2**64 - 1, 0]
    assert not any(c.request.sampling.HasField("seed") for c in _choices({"prompt": "a", "n": 3}))


def test_a_lone_choice_is_its_request_with_the_requests_id() -> None:
    call = completion_request({"prompt": "a", "seed": 5}, LIMITS)
    (choice,) = choices_of(call, "r")
    assert choice.request is call.requests[0]  # no copy of a prompt that may be megabytes of rows
    assert (choice.index, choice.request.request_id, choice.request.sampling.seed) == (0, "r", 5)


def test_choice_0_of_each_prompt_alone_asks_for_its_prompt_logprobs() -> None:
    # Scoring a prompt runs its prefill past the prefix cache and holds the caller's budget: once a prompt.
    choices = _choices({"prompt": ["a", "b"], "n": 3, "prompt_logprobs": 4})
    asked = [
        c.request.output.prompt_logprobs if c.request.output.HasField("prompt_logprobs") else None
        for c in choices
    ]
    assert asked == [4, None, None, 4, None, None]
