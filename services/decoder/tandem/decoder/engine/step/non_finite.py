"""Non-finite logits end the one request they belong to, never the step nor its neighbours.

NOTE: a model can still produce NaN or infinity for one request's row (float16 overflow, a bad
checkpoint) while its neighbours' rows stay right: from the LM head on every row is computed apart,
and attention reads each sequence's own blocks. No token follows from such a row (the argmax of NaN
is any token, whatever a grammar allows), so the request ends with ModelFault (INTERNAL) naming the
position, its KV blocks are freed, and the step's other requests keep exactly the tokens they get
without it. The rows are found where the logits are reduced anyway: the sampler's row max
(`SamplerOutput.is_finite`) and the prompt scorer's (`PromptLogprobsChunk.first_non_finite`).

Speculation: a request's rows verify a proposal in order, and row j counts only once the proposal's
first j tokens were accepted. A non-finite row's sample is replaced by NON_FINITE, which equals no
proposed token, so verification stops there: the tokens before it are the request's, as in a plain
run, and the request ends at output position n + j, where a plain run would end too.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.client.errors import ModelFault

NON_FINITE = -1  # stands for the sample of a non-finite row: no proposal holds it (token IDs are >= 0)


def mark_non_finite(token_ids: Sequence[int], is_finite: Sequence[bool]) -> list[int]:
    """The step's samples, one per row, with NON_FINITE where the row's logits were not finite."""
    return [t if ok else NON_FINITE for t, ok in zip(token_ids, is_finite, strict=True)]


def cut_at_non_finite(tokens: list[int]) -> tuple[list[int], int | None]:
    """One request's verified tokens (from `mark_non_finite`'s samples) without the NON_FINITE that
    ends them, and its index among them: the output position past the request's current ones where
    the model failed. (tokens, None) when every row it used was finite."""
    if tokens and tokens[-1] == NON_FINITE:
        return tokens[:-1], len(tokens) - 1
    return tokens, None


def at_output(position: int, adapter: str = "") -> ModelFault:
    """The error of a request whose logits for output token `position` (0 = the first) were not finite.
    `adapter`: the LoRA adapter the request ran on, if any: the likelier cause, named."""
    return ModelFault(
        f"the model produced non-finite logits (NaN or infinity) at output position {position}"
        f"{_on(adapter)}; the request was ended there"
    )


def at_prompt(position: int, adapter: str = "") -> ModelFault:
    """The error of a request whose logits scoring prompt position `position` were not finite."""
    return ModelFault(
        f"the model produced non-finite logits (NaN or infinity) scoring prompt position {position} "
        f"(prompt_logprobs){_on(adapter)}; the request was ended there"
    )


def _on(adapter: str) -> str:
    # The base model serves every other request, so an adapter's update (its weights or lora_alpha
    # overflowing the activations) is the likelier cause; the caller can try the request without it.
    if not adapter:
        return ""
    return f" with LoRA adapter {adapter!r} (its update may overflow the model's activations)"
