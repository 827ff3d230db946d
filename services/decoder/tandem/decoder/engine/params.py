"""Per-request sampling and stopping parameters.

Pure Python: the scheduler, the sampler and the servicer all read these. Validation lives here so
that every entry point (gRPC, the in-process API, the CLI) rejects the same values with the same
field names; a `ParamError` names the field and the limit it broke.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from decimal import Decimal

from tandem.client.errors import InvalidArgument
from tandem.common.torch_part.prompt_parts import check_token_id, check_token_ids

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20
# Tiny values inside the documented ranges, and what they mean (the sampler's docstring says why):
MIN_SAMPLING_TEMPERATURE = 1e-5  # a temperature below it is greedy, like 0
MIN_REPETITION_PENALTY = 1e-5  # a repetition penalty below it acts as this value


class ParamError(InvalidArgument):
    """A sampling or stopping value outside its range. `field` is the request field's path."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next token. Defaults are the identity (plain softmax sampling)."""

    temperature: float = 1.0  # below 1e-5 (0 included) greedy; else logits / temperature. [0, 100].
    top_p: float = 1.0  # nucleus mass kept, (0, 1]; 1 disables.
    top_k: int = 0  # keep the k most likely tokens; 0 disables.
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob, [0, 1]; 0 disables.
    # CTRL-style over the prompt's token IDs (not its embedding positions) and the output tokens,
    # (0, 10]; 1 disables. Below 1e-5 it acts as 1e-5.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # subtracted once per distinct output token, [-2, 2].
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output, [-2, 2].
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added logit, [-100, 100].
    seed: int | None = None  # a seeded request samples the same tokens whatever shares its batch.
    logprobs: bool = False  # return the log-probability of each sampled token.
    top_logprobs: int = 0  # also return the n most likely tokens at each step, [0, MAX_TOP_LOGPROBS].
    # Score the prompt (outputs/prompt_logprobs.py): each position's logprob given the ones before it, with
    # this many most likely tokens, [0, MAX_TOP_LOGPROBS]; None = off. The model's raw distribution:
    # none of the fields above applies to it.
    prompt_logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int, prefix: str = "sampling") -> None:
        _check_range(f"{prefix}.temperature", self.temperature, 0.0, 100.0)
        if not (0.0 < self.top_p <= 1.0) or math.isnan(self.top_p):
            raise ParamError(f"{prefix}.top_p", f"must be in (0, 1], got {shown_float(self.top_p)}")
        if self.top_k < 0:
            raise ParamError(f"{prefix}.top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        _check_range(f"{prefix}.min_p", self.min_p, 0.0, 1.0)
        if not (0.0 < self.repetition_penalty <= 10.0) or math.isnan(self.repetition_penalty):
            raise ParamError(
                f"{prefix}.repetition_penalty",
                f"must be in (0, 10], got {shown_float(self.repetition_penalty)}",
            )
        _check_range(f"{prefix}.presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range(f"{prefix}.frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ParamError(f"{prefix}.logit_bias", f"at most {MAX_LOGIT_BIAS} entries")
        for token_id, bias in self.logit_bias.items():
            check_token_id(token_id, f"{prefix}.logit_bias[{token_id}]", vocab_size)
            _check_range(f"{prefix}.logit_bias[{token_id}]", bias, -100.0, 100.0)
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            # The wire puts top_logprobs with the output options, so the error names it there.
            raise ParamError(
                "output.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ParamError(
                "output.prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}"
            )


@dataclass(frozen=True)
class StoppingParams:
    """When a request ends. EOS ids come from the checkpoint, not from here."""

    max_new_tokens: int = 256  # hard cap on generated tokens, >= 1.
    # EOS and stop tokens are masked (unless a grammar allows nothing else), and stop strings not looked
    # for, until this many were generated.
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()  # stop strings; may span tokens. Text is held back until unambiguous.
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the request.
    ignore_eos: bool = False  # keep going past the checkpoint's EOS ids.
    include_stop_in_output: bool = False  # emit the matched stop string / token text.

    def validate(self, vocab_size: int, prefix: str = "stopping") -> None:
        if self.max_new_tokens < 1:
            raise ParamError(f"{prefix}.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ParamError(
                f"{prefix}.min_new_tokens",
                f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ParamError(
                f"{prefix}.stop_sequences", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
            )
        for i, s in enumerate(self.stop):
            if not s:
                raise ParamError(f"{prefix}.stop_sequences[{i}]", "must not be empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ParamError(
                    f"{prefix}.stop_sequences[{i}]", f"at most {MAX_STOP_STRING_CHARS} characters"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ParamError(f"{prefix}.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        check_token_ids(self.stop_token_ids, f"{prefix}.stop_token_ids", vocab_size)


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if math.isnan(value) or not low <= value <= high:
        raise ParamError(name, f"must be in [{low}, {high}], got {shown_float(value)}")


def shown_float(value: float) -> str:
    """`value` as its caller wrote it: the wire's float fields are float32, so -0.1 arrives as
    -0.10000000149011612, and the shortest decimal that is the same float32 is what was sent. A value
    no float32 holds exactly (the in-process API's doubles) is shown whole."""
    try:
        if value != 0 and math.isfinite(value) and _as_float32(value) == value:
            return _shortest_float32(value)
    except OverflowError:  # a double beyond float32's range
        pass
    return repr(value)


def _shortest_float32(value: float) -> str:
    """The shortest decimal that reads back as the float32 `value`. At each length the nearest decimal
    and its two neighbours in the last digit are tried: the nearest alone misses where the float32's
    neighbours are not equally far (a power of two): 2**90 was 1.23794004e+27, as 1.2379400e+27 is
    another float32 but 1.2379401e+27 is not. Pure Python: the engine's modules import no numpy."""
    exact = Decimal(value)
    for digits in range(1, 10):
        mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
        step = Decimal(1).scaleb(1 - digits)
        found = [
            Decimal(f"{m}e{exponent}")
            for m in (Decimal(mantissa), Decimal(mantissa) - step, Decimal(mantissa) + step)
            if _as_float32(float(f"{m}e{exponent}")) == value
        ]
        if found:
            return repr(float(min(found, key=lambda d: abs(d - exact))))
    return repr(value)


def _as_float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


@dataclass(frozen=True)
class StructuredOutput:
    """A request's structured output (sampling/structured.py compiles it): which kind, and its text."""

    kind: str  # "json_schema", "json_object", "regex", "choice" or "grammar" (Lark)
    source: str | tuple[str, ...]  # the schema / regex / Lark grammar text, or the choices

    @property
    def field(self) -> str:
        return f"structured.{self.kind}"
