"""Batched next-token sampling with per-request parameters.

NOTE: every step is a small function over the whole batch, applied in a fixed order:
    penalties -> logit bias -> min-tokens mask -> temperature -> min-p -> top-k/top-p -> sample.
Greedy rows take the argmax of the logits after the mask: temperature never moves the argmax and
truncation never removes it, so they skip the rest. Logprobs are "processed" (vLLM's term): the
log_softmax of the logits after penalties, bias, mask and temperature (1 for greedy rows), before
min-p/top-k/top-p truncation, so every top-n entry is finite unless the mask forbade it.

NOTE: tiny values. Every value inside the documented ranges gives finite logprobs; the two that
divide the logits are bounded away from 0, where logits / value overflows to inf and softmax then
makes NaN (the token became 0, every logprob NaN):
- a temperature below MIN_SAMPLING_TEMPERATURE (1e-5) is greedy, exactly like 0: the argmax, with
  logprobs at temperature 1. The limit of a shrinking temperature is the argmax anyway; 1e-5 already
  scales a logit gap of 1 to 1e5, which leaves the runner-up a probability of 0 in float32.
- a repetition penalty below MIN_REPETITION_PENALTY (1e-5) acts as 1e-5: seen tokens with a positive
  logit still outrank every unseen one, as the tiny value asked for, by a finite margin.
With both floors a logit can grow by a factor of at most 1e10, so it stays finite in float32 for
any logit a model produces (below 1e28 in magnitude).

NOTE: non-finite logits. A model can still produce NaN or infinity (float16 overflow, a bad
checkpoint); every step above then turns the row into NaN, and the argmax of NaN is token 0 or any
other, whatever a grammar allows. The sampler cannot make such a row right, so it says which rows
they are (`is_finite`, from one max over the raw logits: NaN and +inf propagate through it, a row of
-inf gives -inf) and the engine ends those requests (step/non_finite.py). Rows are independent, so a
neighbour's token never depends on such a row.

Sampling is an exponential race: argmax(probs / q) with q ~ Exponential(1) i.i.d. over the vocabulary
picks token i with probability probs[i]. A seeded row draws its q from its own generator, over the
full vocabulary, once per step, so its tokens depend only on its logits and its generator: not on its
batch row nor on its neighbours. Rows without a generator share one draw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.decoder.engine.params import MIN_REPETITION_PENALTY, SamplingParams


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token per row, and the logprobs when any row asked for them."""

    token_ids: torch.Tensor  # [batch] int64; meaningless where is_finite is False
    # [batch] bool: False where the model's logits row holds NaN or +inf or is -inf throughout
    is_finite: torch.Tensor
    logprobs: torch.Tensor | None  # [batch] float32, processed logprob of each sampled token
    top_token_ids: torch.Tensor | None  # [batch, num_top_logprobs] int64, most likely first
    top_logprobs: torch.Tensor | None  # [batch, num_top_logprobs] float32; a row keeps its own n


@dataclass(frozen=True)
class SamplingBatch:
    """The batch's sampling parameters as tensors on the logits' device.

    Built by `build` only when the batch composition changes, so a step does no per-request Python
    work beyond counting output tokens for penalties. An optional tensor is None when no row uses
    its feature, which lets the sampler skip that step.
    """

    vocab_size: int
    temperature: torch.Tensor  # [batch] float32 >= MIN_SAMPLING_TEMPERATURE; greedy rows hold 1.0
    is_greedy: torch.Tensor  # [batch] bool
    is_all_greedy: bool  # no row samples: argmax only
    top_k: torch.Tensor | None  # [batch] int64 in [1, vocab_size]; disabled rows hold vocab_size
    top_p: torch.Tensor | None  # [batch] float32; disabled rows hold 1.0
    min_p: torch.Tensor | None  # [batch] float32; disabled rows hold 0.0
    # [batch] float32, at least MIN_REPETITION_PENALTY; None together with the two below
    repetition_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None  # [batch] float32
    frequency_penalty: torch.Tensor | None  # [batch] float32
    is_prompt_token: torch.Tensor | None  # [batch, vocab_size] bool, token positions only; with penalties
    logit_bias_index: torch.Tensor | None  # [num_biases] int64, flat index row * vocab_size + token
    logit_bias_value: torch.Tensor | None  # [num_biases] float32
    generators: tuple[torch.Generator | None, ...]  # [batch]; a seeded row's own generator
    shared_rows: torch.Tensor  # [num_shared] int64, rows drawing noise from the shared generator
    num_top_logprobs: int  # widest top_logprobs in the batch; 0 returns no top-n
    has_logprobs: bool  # some row asked for logprobs or top-n

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty is not None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],  # [batch]
        generators: Sequence[torch.Generator | None],  # [batch]; on `device`, None = unseeded
        prompt_token_ids: Sequence[Sequence[int]],  # [batch][prompt_len], for the repetition penalty
        # [batch][prompt_len] True = a token ID. Embedding positions hold a placeholder ID (0), never
        # a prompt token: the repetition penalty reads the token positions only.
        is_token_ids: Sequence[Sequence[bool]],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        if not len(params) == len(generators) == len(prompt_token_ids) == len(is_token_ids):
            raise ValueError("params, generators, prompt_token_ids and is_token_ids need one entry per row")
        sampling = [p for p in params if not p.is_greedy]

        def column(values: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        has_penalties = any(p.has_penalties for p in params)
        bias_index = [row * vocab_size + t for row, p in enumerate(params) for t in p.logit_bias]
        bias_value = [b for p in params for b in p.logit_bias.values()]
        is_prompt_token = None
        if has_penalties:
            tokens = prompt_tokens(prompt_token_ids, is_token_ids)
            is_prompt_token = count_tokens(tokens, vocab_size, device) > 0  # [batch, vocab_size]
        return cls(
            vocab_size=vocab_size,
            temperature=column([p.temperature if not p.is_greedy else 1.0 for p in params]),
            is_greedy=column([p.is_greedy for p in params], torch.bool),
            is_all_greedy=not sampling,
            top_k=column([min(p.top_k, vocab_size) or vocab_size for p in params], torch.int64)
            if any(0 < p.top_k < vocab_size for p in sampling)
            else None,
            top_p=column([p.top_p for p in params]) if any(p.top_p < 1.0 for p in sampling) else None,
            min_p=column([p.min_p for p in params]) if any(p.min_p > 0.0 for p in sampling) else None,
            repetition_penalty=column([max(p.repetition_penalty, MIN_REPETITION_PENALTY) for p in params])
            if has_penalties
            else None,
            presence_penalty=column([p.presence_penalty for p in params]) if has_penalties else None,
            frequency_penalty=column([p.frequency_penalty for p in params]) if has_penalties else None,
            is_prompt_token=is_prompt_token,
            logit_bias_index=column(bias_index, torch.int64) if bias_index else None,
            logit_bias_value=column(bias_value) if bias_index else None,
            generators=tuple(generators),
            shared_rows=column([r for r, g in enumerate(generators) if g is None], torch.int64),
            num_top_logprobs=max((p.top_logprobs for p in params), default=0),
            has_logprobs=any(p.logprobs or p.top_logprobs > 0 for p in params),
        )


def prompt_tokens(
    prompt_token_ids: Sequence[Sequence[int]], is_token_ids: Sequence[Sequence[bool]]
) -> list[list[int]]:
    """Each row's prompt token IDs, without the placeholders at embedding positions. [batch][*]."""
    rows = []
    for ids, is_token in zip(prompt_token_ids, is_token_ids, strict=True):
        if len(ids) != len(is_token):
            raise ValueError(f"is_token_ids has {len(is_token)} entries for a prompt of {len(ids)}")
        rows.append([t for t, keep in zip(ids, is_token, strict=True) if keep])
    return rows


def count_tokens(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """Occurrences of each token per row: [batch, vocab_size] int32."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    # Pad with an extra id, `vocab_size`, whose column is dropped after counting.
    padded = torch.tensor(
        [list(ids) + [vocab_size] * (max_len - len(ids)) for ids in token_ids],
        dtype=torch.int64,
        device=device,
    ).view(len(token_ids), max_len)  # [batch, max_len]
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties_(
    logits: torch.Tensor,  # [batch, vocab] float32, modified in place
    output_counts: torch.Tensor,  # [batch, vocab] int32
    is_prompt_token: torch.Tensor,  # [batch, vocab] bool
    repetition_penalty: torch.Tensor,  # [batch]
    presence_penalty: torch.Tensor,  # [batch]
    frequency_penalty: torch.Tensor,  # [batch]
) -> None:
    """CTRL repetition penalty over prompt and output tokens, then OpenAI presence/frequency over output."""
    is_output_token = output_counts > 0
    penalty = repetition_penalty[:, None].expand_as(logits)
    # A penalty > 1 makes a seen token less likely whatever its sign: shrink positives, grow negatives.
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits.copy_(torch.where(is_prompt_token | is_output_token, penalised, logits))
    logits -= frequency_penalty[:, None] * output_counts
    logits -= presence_penalty[:, None] * is_output_token


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose prob is below min_p times the row's top prob. logits: [batch, vocab]."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [batch, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,  # [batch, vocab]
    top_k: torch.Tensor | None,  # [batch] int64 in [1, vocab]
    top_p: torch.Tensor | None,  # [batch] float32 in (0, 1]
) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus with -inf; one sort serves both. [batch, vocab]."""
    sorted_logits, sorted_index = logits.sort(dim=-1)  # ascending: the kept tokens are at the end
    if top_k is not None:
        # Ties with the k-th largest value are kept, which never changes the distribution's support much
        # and needs no tie-breaking.
        kth_largest = sorted_logits.gather(1, (logits.shape[-1] - top_k)[:, None])  # [batch, 1]
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [batch, vocab]
        is_outside = cumulative <= 1.0 - top_p[:, None]
        is_outside[:, -1] = False  # the most likely token always survives
        sorted_logits.masked_fill_(is_outside, float("-inf"))
    return logits.scatter(1, sorted_index, sorted_logits)


def grammar_first(banned: Sequence[int], allowed: torch.Tensor) -> Sequence[int]:
    """The ids min_new_tokens bans in a row (EOS and stop tokens), or none where its grammar's `allowed`
    ([vocab] bool) holds nothing else: the grammar's end takes precedence, so its answer ends as the
    grammar says rather than with a token it refuses. Per row, from that row's own mask and position,
    so a verifying row decides as the plain step at its position would."""
    if not banned:
        return banned
    ids = torch.tensor(banned, dtype=torch.long, device=allowed.device)
    return banned if int(allowed.sum()) > int(allowed[ids].sum()) else []


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


class Sampler:
    """Picks the next token of every row. Stateless apart from the generator unseeded rows share."""

    def __init__(
        self,
        generator: torch.Generator | None = None,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,  # [batch, vocab] -> int64 [batch]
    ) -> None:
        self.generator = generator  # None uses torch's global generator for the device
        # The executor's argmax (a C one on CPU), exactly torch.argmax(dim=-1); None: torch's.
        self.argmax = argmax or _torch_argmax

    def __call__(
        self,
        logits: torch.Tensor,  # [batch, vocab] any float dtype; not modified
        batch: SamplingBatch,
        output_token_ids: Sequence[Sequence[int]],  # [batch][num_output], read only with penalties
        min_tokens_mask_ids: Sequence[Sequence[int]] | None = None,  # [batch][*] ids forbidden this step
        allowed: Sequence[torch.Tensor | None] | None = None,  # [batch] bool [vocab] (a grammar) or None
    ) -> SamplerOutput:
        if logits.shape != (len(batch.generators), batch.vocab_size):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match the sampling batch")
        is_finite = torch.isfinite(logits.amax(dim=-1))  # [batch]; 32 x 49,152: 50-80 us on a CPU core
        if min_tokens_mask_ids is not None and allowed is not None:
            min_tokens_mask_ids = [
                ids if mask is None else grammar_first(ids, mask)
                for ids, mask in zip(min_tokens_mask_ids, allowed, strict=True)
            ]
        has_mask = min_tokens_mask_ids is not None and any(min_tokens_mask_ids)
        has_grammar = allowed is not None and any(mask is not None for mask in allowed)
        if batch.is_all_greedy and not (
            batch.has_penalties or batch.logit_bias_index is not None or has_mask or has_grammar
        ):
            # Fast path: the processed logits are the raw ones, so no copy and no softmax unless asked.
            return self._output(self.argmax(logits), is_finite, logits, batch)

        logits = logits.to(torch.float32, copy=True)
        if batch.has_penalties:
            apply_penalties_(
                logits,
                count_tokens(output_token_ids, batch.vocab_size, logits.device),
                batch.is_prompt_token,
                batch.repetition_penalty,
                batch.presence_penalty,
                batch.frequency_penalty,
            )
        if batch.logit_bias_index is not None:
            logits.view(-1).index_add_(0, batch.logit_bias_index, batch.logit_bias_value)
        if has_mask:
            rows = [r for r, ids in enumerate(min_tokens_mask_ids) for _ in ids]
            cols = [t for ids in min_tokens_mask_ids for t in ids]
            logits[rows, cols] = float("-inf")
        if has_grammar:
            assert allowed is not None
            for row, mask in enumerate(allowed):
                if mask is not None:
                    logits[row].masked_fill_(~mask.to(logits.device), float("-inf"))
        greedy_ids = self.argmax(logits)  # [batch]
        if batch.is_all_greedy:
            return self._output(greedy_ids, is_finite, logits, batch)

        # Truncation below is out of place, so `processed` keeps the logits the logprobs describe.
        processed = logits.div_(batch.temperature[:, None])
        if batch.min_p is not None:
            logits = apply_min_p(logits, batch.min_p)
        if batch.top_k is not None or batch.top_p is not None:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        sampled_ids = self._exponential_race(logits.softmax(dim=-1), batch)
        token_ids = torch.where(batch.is_greedy, greedy_ids, sampled_ids)
        return self._output(token_ids, is_finite, processed, batch)

    def _exponential_race(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """argmax(probs / q), q ~ Exponential(1). probs: [batch, vocab]; returns [batch] int64."""
        noise = torch.empty_like(probs)
        if len(batch.shared_rows) == len(probs):
            noise.exponential_(generator=self.generator)
        elif len(batch.shared_rows) > 0:
            shared = torch.empty(len(batch.shared_rows), probs.shape[-1], device=probs.device)
            noise[batch.shared_rows] = shared.exponential_(generator=self.generator)
        for row, generator in enumerate(batch.generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _output(
        token_ids: torch.Tensor, is_finite: torch.Tensor, processed: torch.Tensor, batch: SamplingBatch
    ) -> SamplerOutput:
        """Attach logprobs of `processed` ([batch, vocab]) when any row asked for them."""
        if not batch.has_logprobs:
            return SamplerOutput(token_ids, is_finite, None, None, None)
        logprobs = processed.float().log_softmax(dim=-1)  # [batch, vocab]
        sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [batch]
        if batch.num_top_logprobs == 0:
            return SamplerOutput(token_ids, is_finite, sampled, None, None)
        top_logprobs, top_token_ids = _top(logprobs, batch.num_top_logprobs)
        return SamplerOutput(token_ids, is_finite, sampled, top_token_ids, top_logprobs)


def _top(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row of logprobs [batch, vocab]: ([batch, k] logprobs, [batch, k]
    int64 ids), most likely first, equals by lowest id, as argmax breaks ties (first maximum): a greedy
    token leads the tokens as likely as it. topk alone orders and picks among equals as it likes."""
    wide = min(k + 1, logprobs.shape[-1])
    values, ids = logprobs.topk(wide, dim=-1)  # [batch, k + 1]: the one after the cut too
    # A row whose k-th value equals the next one left equals out, maybe lower ids: take the row's
    # lowest (rare with real logits; a greedy tie of two at the top of a top 1 is one).
    tied = (values[:, k - 1] == values[:, -1]).nonzero().flatten().tolist() if wide > k else []
    values, ids = values[:, :k].clone(), ids[:, :k].clone()
    for row in tied:
        threshold = values[row, -1]
        above = (logprobs[row] > threshold).nonzero().flatten()
        at = (logprobs[row] == threshold).nonzero().flatten()[: k - len(above)]
        ids[row] = torch.cat((above, at))
        values[row] = logprobs[row, ids[row]]
    by_id = ids.argsort(dim=-1)  # ids ascending, then a stable sort by value: equals in id order
    ids, values = ids.gather(1, by_id), values.gather(1, by_id)
    order = values.sort(dim=-1, descending=True, stable=True).indices
    return values.gather(1, order), ids.gather(1, order)
