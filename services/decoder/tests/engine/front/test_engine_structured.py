"""Structured output meets the stopping rules in the engine: the grammar's end takes precedence over
min_new_tokens, plain, batched and speculating alike."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import tokenizers

from services.decoder.tests.engine.engine_helpers import RecordingMatcher
from services.decoder.tests.engine.engine_helpers import finished as _finished
from services.decoder.tests.engine.engine_helpers import run_concurrently as _run_concurrently
from services.decoder.tests.engine.engine_helpers import tokens as _tokens
from tandem.client.errors import InvalidArgument, ResourceExhausted
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Delta, Event, Failed, Finished, FinishReason
from tandem.decoder.engine.params import SamplingParams, StoppingParams, StructuredOutput
from tandem.decoder.engine.sampling import prompt_lookup, structured
from tandem.decoder.engine.sampling.grammar_memory import MIB, GrammarMemoryBudget
from tandem.decoder.engine.step import grammar_budget
from tandem.decoder.models.loader import LoadedModel

PROMPT = [3, 4]


def _engine(model_dir: Path, loaded: LoadedModel, **overrides) -> Engine:
    settings = dict(model_dir=model_dir, dtype="float32", num_kv_blocks=512, block_size=4, max_num_seqs=16)
    return Engine(EngineConfig(**(settings | overrides)), loaded)


def test_a_grammar_that_can_only_end_ends_the_answer_before_min_new_tokens(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    """min_new_tokens holds EOS and stop tokens back, but where they are all the grammar allows, the
    grammar wins: EOS, its end, ends the answer; a stop token it needs as text is taken as text within
    the minimum and ends the answer only after it; never a token the grammar refuses and a failure.
    Batched beside a plain request, the same tokens."""
    eos = tiny_fp32.config.eos_token_ids[0]
    y = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).token_to_id("y")
    greedy = SamplingParams(temperature=0.0)
    choice = GenerateSpec(
        [PROMPT],
        greedy,
        StoppingParams(max_new_tokens=20, min_new_tokens=10),
        structured=StructuredOutput("choice", ("yes", "no")),
    )
    # The tiny vocabulary spells "yyyyyy" only with "y": the stop token is the grammar's one option.
    stop = GenerateSpec(
        [PROMPT],
        greedy,
        StoppingParams(max_new_tokens=20, min_new_tokens=4, stop_token_ids=[y]),
        structured=StructuredOutput("choice", ("yyyyyy",)),
    )
    plain = GenerateSpec([[5, 6]], greedy, StoppingParams(max_new_tokens=8, ignore_eos=True))
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        alone = [list(engine.generate(spec)) for spec in (choice, stop)]
        batched = _run_concurrently(engine, [choice, plain, stop])
    ended = _finished(alone[0])
    assert (ended.reason, _tokens(alone[0])[-1]) == (FinishReason.EOS, eos)
    assert ended.output_tokens < 10
    assert "".join(e.text for e in alone[0] if isinstance(e, Delta)) in ("yes", "no")
    stopped = _finished(alone[1])
    # Four y of text within min_new_tokens=4 (a 1-token answer ended by its stop token before), then
    # the stop token ends it.
    assert (stopped.reason, stopped.stop_token_id, _tokens(alone[1])) == (FinishReason.STOP_TOKEN, y, [y] * 5)
    assert "".join(e.text for e in alone[1] if isinstance(e, Delta)) == "yyyy"
    assert [_tokens(e) for e in (batched[0], batched[2])] == [_tokens(e) for e in alone]


@pytest.mark.parametrize(
    "sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=1)]
)
@pytest.mark.parametrize("min_new_tokens", [0, 8])
def test_a_proposal_holding_the_grammars_end_and_eos_verifies_as_plain_steps_go(
    tiny_model_dir: Path,
    tiny_fp32: LoadedModel,
    monkeypatch: pytest.MonkeyPatch,
    sampling: SamplingParams,
    min_new_tokens: int,
) -> None:
    """Proposed: the whole plain answer, its EOS included (prompt lookup copies a chat's end marker).
    Each verifying row lifts min_new_tokens' ban as a plain step at its position would; and the
    grammar's state after the masks along the proposal is where it was (it failed the request)."""
    spec = GenerateSpec(
        [PROMPT],
        sampling,
        StoppingParams(max_new_tokens=20, min_new_tokens=min_new_tokens),
        structured=StructuredOutput("json_schema", '{"type": "boolean"}'),
    )
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        plain = list(engine.generate(spec))
    answer = _tokens(plain)
    assert answer[-1] == tiny_fp32.config.eos_token_ids[0]

    def propose(lookup: prompt_lookup.PromptLookup, max_tokens: int) -> list[int]:
        done = len(lookup.history) - len(PROMPT)
        return answer[done : done + max_tokens]

    monkeypatch.setattr(prompt_lookup.PromptLookup, "propose", propose)
    with _engine(tiny_model_dir, tiny_fp32, speculative_tokens=4, speculative_max_batch=64) as engine:
        speculating = list(engine.generate(spec))
    assert _tokens(speculating) == answer
    assert _finished(speculating).reason == _finished(plain).reason == FinishReason.EOS
    assert _finished(speculating).accepted_tokens > 0


def test_a_proposal_is_cut_to_the_masks_its_share_of_the_step_budget_pays_for(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each verifying row costs a mask: 16 proposed tokens of an ambiguous grammar at 30 ms a mask
    cost 510 ms in one step. At 100 ms a mask (faked) and a 250 ms budget a request verifies at most
    1 proposed token a step (2 masks), and its tokens are those of plain steps."""
    spec = GenerateSpec(
        [PROMPT],
        SamplingParams(temperature=0.0),
        StoppingParams(max_new_tokens=12),
        structured=StructuredOutput("regex", "[a-z]{12}"),
    )
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        answer = _tokens(engine.generate(spec))

    def propose(lookup: prompt_lookup.PromptLookup, max_tokens: int) -> list[int]:
        done = len(lookup.history) - len(PROMPT)
        return answer[done : done + max_tokens]

    validated: list[int] = []
    valid_prefix = structured.Constraint.valid_prefix

    def recording(constraint: structured.Constraint, token_ids: list[int]) -> int:
        validated.append(len(token_ids))
        return valid_prefix(constraint, token_ids)

    monkeypatch.setattr(prompt_lookup.PromptLookup, "propose", propose)
    monkeypatch.setattr(structured.Constraint, "valid_prefix", recording)
    monkeypatch.setattr(structured.Constraint, "mask_seconds", property(lambda _: 0.1))
    # A per-token limit over the faked cost, so that only the step's budget weighs it.
    settings = dict(speculative_tokens=4, max_grammar_cpu_ms_per_step=250.0, max_grammar_cpu_ms_per_token=1e4)
    with _engine(tiny_model_dir, tiny_fp32, **settings) as engine:
        speculating = list(engine.generate(spec))
    assert _tokens(speculating) == answer
    assert validated and max(validated) == 1
    assert _finished(speculating).accepted_tokens > 0


@pytest.mark.parametrize("speculative_tokens", [0, 4])
def test_a_requests_first_step_takes_the_first_mask_its_grammar_was_built_with(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch, speculative_tokens: int
) -> None:
    """The grammar's building thread computes the request's first mask, and its first step computed
    it again (a{300}{100}: 4-6 ms of the step's CPU with this tokenizer). Now one mask per token, the
    first on the building thread; the same tokens as where the step computes it, plain and speculating."""
    spec = GenerateSpec(
        [PROMPT],
        SamplingParams(temperature=0.0),
        StoppingParams(max_new_tokens=6),
        structured=StructuredOutput("regex", "[a-z ]{100}"),  # no end within 6 tokens
    )
    settings = dict(speculative_tokens=speculative_tokens, speculative_max_batch=64)
    constraint = structured.Constraint
    with monkeypatch.context() as patched:  # the reference: each constraint computes its first mask
        patched.setattr(
            structured, "Constraint", lambda *args, first_bitmask=None, **kw: constraint(*args, **kw)
        )
        with _engine(tiny_model_dir, tiny_fp32, **settings) as engine:
            reference = _tokens(engine.generate(spec))
    matchers: list[RecordingMatcher] = []
    build = structured.GrammarCompiler._matcher
    monkeypatch.setattr(
        structured.GrammarCompiler,
        "_matcher",
        lambda self, verdict, *limit: (
            matchers.append(RecordingMatcher(build(self, verdict, *limit))) or matchers[-1]
        ),
    )
    with _engine(tiny_model_dir, tiny_fp32, **settings) as engine:
        answer = _tokens(engine.generate(spec))
    assert answer == reference and len(answer) == 6
    request, _trial = matchers  # built for the request, and for its trial first token
    assert request.threads[0] == "tandem-grammar-compile"
    if not speculative_tokens:  # a verifying row's mask is one more (a proposal's, rolled back)
        assert len(request.threads) == len(answer)


def test_a_step_whose_grammars_cost_over_its_budget_fails_them_and_its_plain_neighbour_goes_on(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One thread computes every mask of a step: 16 grammars each under their own per-token limit
    cost 700 ms a step. Over --max-grammar-cpu-ms-per-step, the grammars fail naming their field and
    the limit; the plain request beside them is unchanged. Here the limit is below any work, so a
    token's mask alone in its step is over it: INVALID_ARGUMENT, as no step fits it and a retry would
    fail the same way (among others' grammar work, RESOURCE_EXHAUSTED: test_grammar_budget). (Every
    grammar counted heavy here: the cheap ones of this test are not otherwise.)"""
    greedy = SamplingParams(temperature=0.0)
    plain = GenerateSpec([[5, 6]], greedy, StoppingParams(max_new_tokens=8, ignore_eos=True))
    grammars = [
        GenerateSpec(
            [PROMPT], greedy, StoppingParams(max_new_tokens=8), structured=StructuredOutput("regex", "a+")
        )
        for _ in range(1)
    ]
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        alone = _tokens(engine.generate(plain))
    with _engine(tiny_model_dir, tiny_fp32, max_grammar_cpu_ms_per_step=1e-6) as engine:
        monkeypatch.setattr(engine.core, "heavy_mask_seconds", -1.0)
        events = _run_concurrently(engine, [plain, *grammars])
    assert _tokens(events[0]) == alone and isinstance(events[0][-1], Finished)
    for failed in events[1:]:
        assert isinstance(failed[-1], Failed) and isinstance(failed[-1].error, InvalidArgument)
        assert failed[-1].error.field == "structured.regex"
        assert str(failed[-1].error).startswith("structured.regex: the grammar's work for one token took")
        assert "over the limit of 1e-06 ms per step (--max-grammar-cpu-ms-per-step) by itself" in str(
            failed[-1].error
        )


def test_ordinary_grammars_are_not_failed_by_the_step_budget_however_many(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    """Only a request whose own masks are heavy (grammar_budget.heavy_mask_seconds on average) fails
    for the step's budget: 64 cold bounded regexes at 3-4 ms a mask each passed 250 ms a step with
    Qwen3's vocabulary, and 41 failed. Here a budget below any work fails none of 8 cheap ones."""
    greedy = SamplingParams(temperature=0.0)
    grammars = [
        GenerateSpec(
            [PROMPT], greedy, StoppingParams(max_new_tokens=4), structured=StructuredOutput("regex", "a+")
        )
        for _ in range(8)
    ]
    with _engine(tiny_model_dir, tiny_fp32, max_grammar_cpu_ms_per_step=1e-6) as engine:
        events = _run_concurrently(engine, grammars)
    assert all(isinstance(each[-1], Finished) for each in events)


def test_the_heavy_floor_is_half_the_per_token_limit_where_that_is_under_20_ms(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    """A fixed 20 ms floor under --max-grammar-cpu-ms-per-token of 20 ms or less made the step's cap
    never fire: a request heavy enough for it had failed for its own limit first."""
    with _engine(tiny_model_dir, tiny_fp32, max_grammar_cpu_ms_per_token=10.0) as engine:
        assert engine.core.heavy_mask_seconds == 0.005
    with _engine(tiny_model_dir, tiny_fp32) as engine:  # the served 50 ms: the floor stays 20 ms
        assert engine.core.heavy_mask_seconds == grammar_budget.HEAVY_MASK_SECONDS == 0.020


def test_a_request_that_finishes_in_the_step_is_not_failed_for_the_steps_budget(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request ended by its step (here max_new_tokens=1) costs no later step: it finishes, whatever
    the step's grammar work cost; its neighbour that goes on fails for the budget."""
    greedy = SamplingParams(temperature=0.0)
    regex = StructuredOutput("regex", "a+")
    ending = GenerateSpec([PROMPT], greedy, StoppingParams(max_new_tokens=1), structured=regex)
    going_on = GenerateSpec([PROMPT], greedy, StoppingParams(max_new_tokens=8), structured=regex)
    with _engine(tiny_model_dir, tiny_fp32, max_grammar_cpu_ms_per_step=1e-6) as engine:
        monkeypatch.setattr(engine.core, "heavy_mask_seconds", -1.0)  # every grammar counted heavy
        ended, failed = _run_concurrently(engine, [ending, going_on])
    assert isinstance(ended[-1], Finished) and ended[-1].reason is FinishReason.LENGTH
    # Over alone (INVALID_ARGUMENT), or beside the ending one's masks where they shared a step.
    assert isinstance(failed[-1], Failed)
    assert isinstance(failed[-1].error, InvalidArgument | ResourceExhausted)


def test_a_grammar_request_counts_its_wait_for_its_building_thread_in_its_metrics(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    """Grammars build one at a time on their own thread: a request queued there behind another's
    compile waited, and its time to first token must say so (stamped when built, a client's 1.56 s
    first token read 0.02 s on the server). Its arrival is when the call came, the servicer's receipt
    or, in process, the stream's start."""
    spec = GenerateSpec(
        [PROMPT],
        SamplingParams(temperature=0.0),
        StoppingParams(max_new_tokens=2),
        structured=StructuredOutput("regex", "a+"),
    )
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        engine._builders.structured.submit("another caller", time.sleep, 0.3)  # another grammar's, in front

        async def collect() -> list[Event]:
            return [event async for event in engine.stream(spec)]

        events = asyncio.run(collect())
    assert isinstance(events[-1], Finished)
    assert events[-1].time_to_first_token_s >= 0.3 and events[-1].queue_time_s >= 0.3


def test_a_cancelled_constrained_requests_matcher_memory_is_given_back(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    """Each live matcher is charged against the engine's matcher memory (sampling/grammar_memory.py)
    until its request's constraint goes, whichever way the request ended: here a cancel mid-answer."""
    spec = GenerateSpec(
        [PROMPT],
        SamplingParams(temperature=0.0),
        StoppingParams(max_new_tokens=500),
        structured=StructuredOutput("regex", "[a-z ]{1000}"),  # no end within the answer
    )
    started = threading.Event()

    def on_event(event: Event) -> None:
        if isinstance(event, Delta):
            started.set()

    with _engine(tiny_model_dir, tiny_fp32) as engine:
        key = engine.submit(spec, on_event)
        assert started.wait(60)
        memory = engine._grammar_compiler().memory
        assert memory.held() > 0
        engine.abort(key)  # applied at the next step; a cancelled stream gets no more events
        deadline = time.monotonic() + 30
        while (memory.held() or engine.core.num_live()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.core.num_live() == 0 and memory.held() == 0


def test_a_request_whose_matcher_grows_past_its_callers_memory_fails_alone_and_frees_its_blocks(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A matcher's lexer states are charged as they grow while decoding (sampling/grammar_growth.py):
    one whose growth its caller's limit refuses ends naming its field and the limit (INVALID_ARGUMENT:
    its caller's only grammar, over the limit alone), its KV blocks and charge given back, and the
    request beside it answers as it does alone."""
    greedy = SamplingParams(temperature=0.0)
    beside = GenerateSpec([[5, 6]], greedy, StoppingParams(max_new_tokens=48, ignore_eos=True))
    growing = GenerateSpec(
        [PROMPT],
        greedy,
        StoppingParams(max_new_tokens=400),
        structured=StructuredOutput("regex", r"[\w .]{1,1000}"),
    )
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        alone = _tokens(engine.generate(beside))
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        memory = GrammarMemoryBudget(max_bytes_per_caller=4 * MIB)  # its build, not its growth
        monkeypatch.setattr(engine._grammar_compiler(), "memory", memory)
        free = engine.core.block_manager.num_free_blocks
        events = _run_concurrently(engine, [beside, growing])
        assert engine.core.num_live() == 0 and engine.core.block_manager.num_free_blocks == free
    assert _tokens(events[0]) == alone and isinstance(events[0][-1], Finished)
    failed = events[1][-1]
    assert isinstance(failed, Failed) and isinstance(failed.error, InvalidArgument)
    assert str(failed.error).startswith("structured.regex: the grammar's matcher grew while decoding")
    assert "over the 4 MiB a caller's live grammars may hold" in str(failed.error)
    assert memory.held() == 0
