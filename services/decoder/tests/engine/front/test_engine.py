"""The engine end to end on a tiny checkpoint: batching never changes a request's tokens."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.decoder.tests.engine.engine_helpers import finished as _finished
from services.decoder.tests.engine.engine_helpers import run_concurrently as _run_concurrently
from services.decoder.tests.engine.engine_helpers import tokens as _tokens
from tandem.client.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from tandem.decoder.api.protocol import event_to_pb
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.chat import ChatMessage, ChatRequest, no_chat_template
from tandem.decoder.engine.admission.prompt import EmbeddingPrompt, GenerateSpec, TextPrompt
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.backpressure import MAX_STREAM_INTERVAL, MAX_UNREAD_TOKENS
from tandem.decoder.engine.outputs.outputs import (
    Accepted,
    Delta,
    Event,
    Failed,
    Finished,
    FinishReason,
    OutputOptions,
)
from tandem.decoder.engine.params import SamplingParams, StoppingParams
from tandem.decoder.models.loader import LoadedModel


def _engine(model_dir: Path, loaded: LoadedModel, **overrides) -> Engine:
    settings = dict(model_dir=model_dir, dtype="float32", num_kv_blocks=512, block_size=4, max_num_seqs=16)
    settings.update(overrides)
    return Engine(EngineConfig(**settings), loaded)


def _alone(engine: Engine, spec: GenerateSpec) -> list[Event]:
    return list(engine.generate(spec))


def _embed(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    return loaded.model.embed_tokens.weight[ids].detach().clone()


def _mixed_specs(loaded: LoadedModel) -> list[GenerateSpec]:
    gen = torch.Generator().manual_seed(1)
    specs = []
    for i in range(8):
        ids = torch.randint(5, 400, (3 + 7 * i,), generator=gen).tolist()
        kind = i % 3
        if kind == 0:
            prompt = [ids]
        elif kind == 1:
            prompt = [
                ids[:2],
                EmbeddingPrompt(torch.randn(4, loaded.config.hidden_size, generator=gen)),
                ids[2:],
            ]
        else:
            prompt = [TextPrompt("The river runs to the sea"), ids]
        sampling = (
            SamplingParams(temperature=0.0)
            if i % 2 == 0
            else SamplingParams(temperature=0.9, top_k=50, seed=i)
        )
        specs.append(
            GenerateSpec(
                prompt, sampling, StoppingParams(max_new_tokens=6 + i, ignore_eos=True), request_id=f"r{i}"
            )
        )
    return specs


def test_concurrent_mixed_requests_each_get_the_tokens_they_get_alone(tiny_model_dir, tiny_fp32) -> None:
    specs = _mixed_specs(tiny_fp32)
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        alone = [_tokens(_alone(engine, spec)) for spec in specs]
        together = _run_concurrently(engine, specs)
    for spec, expected, events in zip(specs, alone, together, strict=True):
        assert isinstance(events[0], Accepted)
        assert _tokens(events) == expected, spec.request_id
        assert _finished(events).output_tokens == spec.stopping.max_new_tokens


def test_greedy_tokens_equal_transformers_generate(tiny_model_dir, tiny_fp32) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompt = [11, 42, 7, 99, 250, 3, 18]
    expected = reference.generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        events = _alone(
            engine,
            GenerateSpec(
                [prompt], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=24, ignore_eos=True)
            ),
        )
    assert _tokens(events) == expected


def test_chunked_prefill_of_a_long_prompt_equals_one_prefill(tiny_model_dir, tiny_fp32) -> None:
    prompt = torch.randint(5, 400, (3000,), generator=torch.Generator().manual_seed(3)).tolist()
    spec = GenerateSpec(
        [prompt], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=4, ignore_eos=True)
    )
    # One step takes the whole prompt (3,000 tokens); the budget may not pass the pool's 4,092 positions.
    with _engine(tiny_model_dir, tiny_fp32, max_num_batched_tokens=3072, num_kv_blocks=1024) as engine:
        whole = _tokens(_alone(engine, spec))
    with _engine(tiny_model_dir, tiny_fp32, max_num_batched_tokens=256, num_kv_blocks=1024) as engine:
        steps_before = engine.core.num_steps
        chunked = _tokens(_alone(engine, spec))
        assert engine.core.num_steps - steps_before >= 3000 // 256
    assert chunked == whole


def test_repeated_prefix_is_served_from_cache_with_the_same_output(tiny_model_dir, tiny_fp32) -> None:
    prefix = list(range(10, 74))  # 16 full blocks of 4
    spec = GenerateSpec([prefix + [5, 6]], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=5))
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        first = _alone(engine, spec)
        second = _alone(engine, spec)
    assert _finished(first).cached_tokens == 0
    assert _finished(second).cached_tokens == 64
    assert _tokens(second) == _tokens(first)


def test_different_embedding_rows_do_not_hit_the_cache(tiny_model_dir, tiny_fp32) -> None:
    hidden = tiny_fp32.config.hidden_size
    rows = torch.randn(16, hidden, generator=torch.Generator().manual_seed(4))
    other = rows.clone()
    other[9] += 0.5  # differs in the third block

    def spec(e: torch.Tensor) -> GenerateSpec:
        return GenerateSpec(
            [EmbeddingPrompt(e), [7, 8]], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=3)
        )

    with _engine(tiny_model_dir, tiny_fp32) as engine:
        _alone(engine, spec(rows))
        same = _finished(_alone(engine, spec(rows.clone())))
        changed = _finished(_alone(engine, spec(other)))
    assert same.cached_tokens == 16
    assert changed.cached_tokens == 8  # the two blocks before the changed row still match


def test_embeddings_equal_to_the_token_table_give_the_token_path_output(tiny_model_dir, tiny_fp32) -> None:
    ids = [20, 21, 22, 23, 24, 25]
    as_tokens = GenerateSpec(
        [ids], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=8, ignore_eos=True)
    )
    as_embeds = GenerateSpec(
        [ids[:2], EmbeddingPrompt(_embed(tiny_fp32, ids[2:5])), ids[5:]],
        SamplingParams(temperature=0.0),
        StoppingParams(max_new_tokens=8, ignore_eos=True),
    )
    with _engine(tiny_model_dir, tiny_fp32, enable_prefix_caching=False) as engine:
        assert _tokens(_alone(engine, as_embeds)) == _tokens(_alone(engine, as_tokens))


def test_a_pool_too_small_preempts_and_every_request_still_completes(tiny_model_dir, tiny_fp32) -> None:
    specs = [
        GenerateSpec(
            [list(range(10 + i, 30 + i))],
            SamplingParams(temperature=0.0),
            StoppingParams(max_new_tokens=24, ignore_eos=True),
            request_id=f"p{i}",
        )
        for i in range(6)
    ]
    with _engine(tiny_model_dir, tiny_fp32, num_kv_blocks=64) as engine:
        alone = [_tokens(_alone(engine, s)) for s in specs]
    # 6 requests x 44 positions need 66 blocks of 4: more than the 63 usable.
    with _engine(tiny_model_dir, tiny_fp32, num_kv_blocks=64, enable_prefix_caching=False) as engine:
        initial = engine.core.block_manager.num_free_blocks
        together = _run_concurrently(engine, specs)
        preemptions = engine.core.num_preemptions
        assert engine.core.block_manager.num_free_blocks == initial
    assert [_tokens(events) for events in together] == alone
    assert preemptions > 0


def test_abort_mid_decode_and_normal_finish_both_return_every_block(tiny_model_dir, tiny_fp32) -> None:
    with _engine(tiny_model_dir, tiny_fp32, enable_prefix_caching=False) as engine:
        initial = engine.core.block_manager.num_free_blocks
        stream = engine.generate(
            GenerateSpec(
                [[1, 2, 3, 4, 5]],
                SamplingParams(temperature=0.0),
                StoppingParams(max_new_tokens=200, ignore_eos=True),
            )
        )
        assert isinstance(next(stream), Accepted)
        assert isinstance(next(stream), Delta)
        stream.close()  # leaving the iterator aborts the request
        _alone(
            engine,
            GenerateSpec([[9, 8, 7]], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=3)),
        )
        assert engine.core.block_manager.num_free_blocks == initial
        assert engine.core.num_live() == 0


def test_finish_all_ends_open_requests_aborted_with_the_tokens_they_have_and_frees_blocks(
    tiny_model_dir, tiny_fp32
) -> None:
    """What a drain does when its grace period runs out: no stream is left without `finished`."""
    with _engine(tiny_model_dir, tiny_fp32, enable_prefix_caching=False) as engine:
        initial = engine.core.block_manager.num_free_blocks
        spec = GenerateSpec(
            [[1, 2, 3, 4, 5]],
            SamplingParams(temperature=0.0),
            StoppingParams(max_new_tokens=300, ignore_eos=True),
        )
        stream = engine.generate(spec)
        events = [next(stream), next(stream)]
        assert isinstance(events[0], Accepted) and isinstance(events[1], Delta)
        assert engine.finish_all(FinishReason.ABORTED) == 1
        events.extend(stream)
        finished = _finished(events)
        assert finished.reason is FinishReason.ABORTED
        assert 1 <= finished.output_tokens < 300
        assert finished.output_tokens == len(_tokens(events))  # every sampled token was sent first
        full = _alone(engine, spec)  # the engine serves on, and the aborted tokens are a true prefix
        assert _tokens(full)[: finished.output_tokens] == _tokens(events)
        assert engine.core.block_manager.num_free_blocks == initial
        assert engine.core.num_live() == 0


def test_static_shapes_see_no_new_signature_after_warmup_and_match_dynamic(tiny_model_dir, tiny_fp32) -> None:
    specs = _mixed_specs(tiny_fp32)
    static = dict(static_shapes=True, max_num_batched_tokens=128, max_num_seqs=8, max_model_len=256)
    with _engine(
        tiny_model_dir, tiny_fp32, max_num_batched_tokens=128, max_num_seqs=8, max_model_len=256
    ) as engine:
        dynamic = [_tokens(events) for events in _run_concurrently(engine, specs)]
    with _engine(tiny_model_dir, tiny_fp32, **static) as engine:
        warmed = set(engine.core.runner.signatures)
        assert warmed
        results = [_tokens(events) for events in _run_concurrently(engine, specs)]
        assert engine.core.runner.signatures == warmed
    assert results == dynamic


def test_stop_string_ends_generation_and_is_not_emitted(tiny_model_dir, tiny_fp32) -> None:
    base = GenerateSpec(
        [TextPrompt("Once upon a time")],
        SamplingParams(temperature=0.0),
        StoppingParams(max_new_tokens=40, ignore_eos=True),
    )
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        text = "".join(e.text for e in _alone(engine, base) if isinstance(e, Delta))
        assert len(text) > 6
        stop = text[3:6]
        spec = GenerateSpec(
            base.prompt, base.sampling, StoppingParams(max_new_tokens=40, ignore_eos=True, stop=(stop,))
        )
        events = _alone(engine, spec)
    finished = _finished(events)
    assert finished.reason == FinishReason.STOP_SEQUENCE
    assert finished.stop_sequence == stop
    assert "".join(e.text for e in events if isinstance(e, Delta)) == text[: text.index(stop)]


def test_stream_interval_coalesces_deltas(tiny_model_dir, tiny_fp32) -> None:
    spec = GenerateSpec(
        [[3, 4, 5]],
        SamplingParams(temperature=0.0),
        StoppingParams(max_new_tokens=10, ignore_eos=True),
        OutputOptions(stream_interval=4),
    )
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        deltas = [e for e in _alone(engine, spec) if isinstance(e, Delta)]
    assert [len(d.token_ids) for d in deltas] == [4, 4, 2]


def test_an_async_reader_that_falls_behind_gets_the_piled_up_deltas_as_one(tiny_model_dir, tiny_fp32) -> None:
    spec = GenerateSpec(
        [[3, 4, 5]],
        SamplingParams(temperature=0.0, logprobs=True),
        StoppingParams(max_new_tokens=12, ignore_eos=True),
    )

    async def read(pause_after_accepted: float) -> list[Event]:
        events = []
        async for event in engine.stream(spec):
            events.append(event)
            if isinstance(event, Accepted):
                await asyncio.sleep(pause_after_accepted)  # the engine runs on while nobody reads
        return events

    with _engine(tiny_model_dir, tiny_fp32) as engine:
        expected = _alone(engine, spec)
        lagging = asyncio.run(read(pause_after_accepted=1.0))
    deltas = [e for e in lagging if isinstance(e, Delta)]
    assert len(deltas) < 12  # merged: one message carries several steps' tokens
    assert isinstance(lagging[0], Accepted) and isinstance(lagging[-1], Finished)
    assert [t for d in deltas for t in d.token_ids] == _tokens(expected)
    assert [lp for d in deltas for lp in d.logprobs] == [
        lp for e in expected if isinstance(e, Delta) for lp in e.logprobs
    ]
    assert "".join(d.text for d in deltas) == "".join(e.text for e in expected if isinstance(e, Delta))


def test_min_new_tokens_suppresses_eos(tiny_model_dir, tiny_fp32) -> None:
    eos = tiny_fp32.config.eos_token_ids[0]
    bias = SamplingParams(temperature=0.0, logit_bias={eos: 100.0})  # EOS is the argmax everywhere
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        first = _finished(_alone(engine, GenerateSpec([[3, 4]], bias, StoppingParams(max_new_tokens=9))))
        held = _finished(
            _alone(engine, GenerateSpec([[3, 4]], bias, StoppingParams(max_new_tokens=9, min_new_tokens=5)))
        )
    assert (first.reason, first.output_tokens) == (FinishReason.EOS, 1)
    assert (held.reason, held.output_tokens) == (FinishReason.EOS, 6)


def test_min_new_tokens_holds_back_stop_strings_as_vllms_min_tokens_does(tiny_model_dir, tiny_fp32) -> None:
    greedy = SamplingParams(temperature=0.0)
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        free = _alone(
            engine, GenerateSpec([[3, 4]], greedy, StoppingParams(max_new_tokens=9, ignore_eos=True))
        )
        second = next(e.text for e in free if isinstance(e, Delta) and e.text.strip())  # a first word
        stop = StoppingParams(max_new_tokens=9, ignore_eos=True, stop=(second,))
        early = _finished(_alone(engine, GenerateSpec([[3, 4]], greedy, stop)))
        held = _alone(engine, GenerateSpec([[3, 4]], greedy, replace(stop, min_new_tokens=6)))
    assert early.reason == FinishReason.STOP_SEQUENCE and early.output_tokens <= 6
    assert _finished(held).output_tokens > 6
    assert "".join(e.text for e in held if isinstance(e, Delta)).startswith(
        "".join(e.text for e in free if isinstance(e, Delta))[:6]
    )


def test_token_only_steps_carry_no_embedding_buffer_and_static_steps_always_do(
    tiny_model_dir, tiny_fp32
) -> None:
    hidden = tiny_fp32.config.hidden_size
    mixed = GenerateSpec(
        [[5, 6], EmbeddingPrompt(torch.randn(3, hidden)), [7]],
        SamplingParams(temperature=0.0),
        StoppingParams(max_new_tokens=3, ignore_eos=True),
    )
    tokens = GenerateSpec(
        [[5, 6, 7]], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=3, ignore_eos=True)
    )
    for static, expect_always in ((False, False), (True, True)):
        with _engine(
            tiny_model_dir,
            tiny_fp32,
            static_shapes=static,
            max_num_batched_tokens=32,
            max_num_seqs=4,
            max_model_len=64,
        ) as engine:
            seen: list[bool] = []
            engine.core.runner.forward = _recording(engine.core.runner.forward, seen)
            _alone(engine, tokens)
            _alone(engine, mixed)
        if expect_always:
            assert all(seen)
        else:
            # tokens: 3 steps without; mixed: the prefill with, then 2 decode steps without.
            assert seen == [False, False, False, True, False, False]


def _recording(forward, seen: list[bool]):
    def wrapped(batch):
        seen.append(batch.inputs.inputs_embeds is not None)
        return forward(batch)

    return wrapped


def test_embedding_positions_are_not_prompt_tokens_for_the_repetition_penalty(
    tiny_model_dir, tiny_fp32
) -> None:
    # Embedding positions carry the placeholder ID 0, and the bias makes token 0 the pick: had the
    # penalty counted it as a prompt token, its logit, and with it every logprob, would move.
    rows = torch.randn(5, tiny_fp32.config.hidden_size, generator=torch.Generator().manual_seed(5))

    def first_step(repetition_penalty: float) -> Delta:
        sampling = SamplingParams(
            temperature=0.0, repetition_penalty=repetition_penalty, logit_bias={0: 30.0}, top_logprobs=5
        )
        spec = GenerateSpec(
            [EmbeddingPrompt(rows)], sampling, StoppingParams(max_new_tokens=1, ignore_eos=True)
        )
        with _engine(tiny_model_dir, tiny_fp32) as engine:
            return next(e for e in _alone(engine, spec) if isinstance(e, Delta))

    penalised, plain = first_step(2.0), first_step(1.0)
    assert penalised.token_ids == plain.token_ids == (0,)
    assert penalised.top_logprobs == plain.top_logprobs


def test_accepted_is_out_before_any_delta_even_while_the_engine_is_busy(tiny_model_dir, tiny_fp32) -> None:
    # Accepted used to go to the callback after the engine lock was released, so a busy engine thread
    # could schedule the request and emit its first Delta while Accepted was still on its way. This
    # callback holds Accepted back until a Delta arrives (or 1 s passes) to open that window wide.
    events: list[Event] = []
    first_delta = threading.Event()
    done = threading.Event()

    def on_event(event: Event) -> None:
        if isinstance(event, Accepted):
            first_delta.wait(1.0)
        elif isinstance(event, Delta):
            first_delta.set()
        events.append(event)
        if isinstance(event, Finished | Failed):
            done.set()

    busy = GenerateSpec([[1, 2, 3]], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=64))
    spec = GenerateSpec([[4, 5]], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=3))
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        background = engine.generate(busy)
        next(background)  # the engine thread now steps without waiting for a wakeup
        engine.submit(spec, on_event)
        assert done.wait(60)
        background.close()
    assert isinstance(events[0], Accepted), [type(e).__name__ for e in events]


def test_the_asyncio_front_builds_requests_off_the_event_loop(tiny_model_dir, tiny_fp32) -> None:
    # Built on the loop, a 30 MB text kept health unanswered for 24 s and stalled every stream.
    spec = GenerateSpec([TextPrompt("hello")], stopping=StoppingParams(max_new_tokens=2))
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        threads: list[str] = []
        make_request = engine.make_request

        def recording(spec: GenerateSpec):
            threads.append(threading.current_thread().name)
            return make_request(spec)

        engine.make_request = recording

        async def run() -> list[Event]:
            return [event async for event in engine.stream(spec)]

        events = asyncio.run(run())
    assert isinstance(events[-1], Finished)
    assert len(threads) == 1 and threads[0].startswith("tandem-requests")


def test_a_caller_that_leaves_while_its_request_is_built_leaves_nothing_behind(
    tiny_model_dir, tiny_fp32
) -> None:
    spec = GenerateSpec([[3, 4]], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=200))
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        building = threading.Event()
        make_request = engine.make_request

        def slow(spec: GenerateSpec):
            building.set()
            threading.Event().wait(0.5)
            return make_request(spec)

        engine.make_request = slow

        async def leave_early() -> None:
            task = asyncio.ensure_future(anext(aiter(engine.stream(spec))))
            await asyncio.to_thread(building.wait, 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(leave_early())
        deadline = time.monotonic() + 10
        while engine.core.num_live() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.core.num_live() == 0
        assert engine.core.block_manager.num_free_blocks == engine.core.block_manager.num_total_blocks


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize(
    "sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=5)]
)
def test_a_request_whose_reader_stops_taking_deltas_pauses_and_resumes_where_it_left_off(
    tiny_model_dir, tiny_fp32, sampling: SamplingParams
) -> None:
    # Unread streams used to be generated at full speed: with 200 of them open, an unrelated
    # 32-token request waited 87.7 s and the server's memory grew by 450 MB.
    stopping = StoppingParams(max_new_tokens=3 * MAX_UNREAD_TOKENS, ignore_eos=True)
    spec = GenerateSpec([[3, 4, 5]], sampling, stopping)
    neighbour = GenerateSpec([[7, 8]], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=8))
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        expected = _tokens(_alone(engine, spec))
        reader = engine.generate(spec)
        assert isinstance(next(reader), Accepted)  # and then nothing is taken for a while
        scheduler, blocks = engine.core.scheduler, engine.core.block_manager
        _wait_for(lambda: scheduler.num_paused == 1)
        paused = next(iter(scheduler.paused.values()))
        assert paused.num_output_tokens == MAX_UNREAD_TOKENS + 1  # one Delta a step, then the pause
        assert blocks.num_free_blocks == blocks.num_total_blocks  # it holds no KV while paused
        assert _finished(_alone(engine, neighbour)).output_tokens == 8  # the engine serves others
        assert paused.num_output_tokens == MAX_UNREAD_TOKENS + 1  # and generated nothing for it
        rest = list(reader)  # reading resumes it
    assert _tokens(rest) == expected
    assert _finished(rest).output_tokens == stopping.max_new_tokens
    assert [e.name for e in _finished(rest).timeline if e.name in ("paused", "resumed")] == [
        "paused",
        "resumed",
    ]


def test_a_huge_stream_interval_cannot_keep_an_unread_request_from_pausing(tiny_model_dir, tiny_fp32) -> None:
    # stream_interval 10^6 sent nothing until the end, so an unread request never fell behind and
    # 640 of them starved a neighbour for 509 s (issue 32). Deltas now come every 16 steps at most,
    # and the pause counts their tokens.
    stopping = StoppingParams(max_new_tokens=8 * MAX_UNREAD_TOKENS, ignore_eos=True)
    spec = GenerateSpec(
        [[3, 4, 5]], SamplingParams(temperature=0.0), stopping, OutputOptions(stream_interval=10**6)
    )
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        expected = _tokens(_alone(engine, spec))
        reader = engine.generate(spec)
        assert isinstance(next(reader), Accepted)
        _wait_for(lambda: engine.core.scheduler.num_paused == 1)
        paused = next(iter(engine.core.scheduler.paused.values()))
        # Paused once more than 64 tokens went unread: the Delta that crossed it, 16 steps.
        assert MAX_UNREAD_TOKENS < paused.num_output_tokens <= MAX_UNREAD_TOKENS + MAX_STREAM_INTERVAL + 1
        rest = list(reader)
    assert _tokens(rest) == expected
    assert len([e for e in rest if isinstance(e, Delta)]) >= len(expected) // MAX_STREAM_INTERVAL


def test_an_async_reader_that_stops_reading_pauses_its_request_until_it_reads_again(
    tiny_model_dir, tiny_fp32
) -> None:
    spec = GenerateSpec(
        [[3, 4, 5]],
        SamplingParams(temperature=0.0),
        StoppingParams(max_new_tokens=2 * MAX_UNREAD_TOKENS, ignore_eos=True),
    )

    async def read_after_the_pause() -> list[Event]:
        events = []
        async for event in engine.stream(spec):
            events.append(event)
            if isinstance(event, Accepted):
                await asyncio.to_thread(_wait_for, lambda: engine.core.scheduler.num_paused == 1)
        return events

    with _engine(tiny_model_dir, tiny_fp32) as engine:
        expected = _tokens(_alone(engine, spec))
        events = asyncio.run(read_after_the_pause())
    assert _tokens(events) == expected
    assert isinstance(events[-1], Finished) and events[-1].output_tokens == 2 * MAX_UNREAD_TOKENS


def test_a_request_scoring_a_long_prompt_pauses_after_that_delta_until_it_is_taken(
    tiny_model_dir, tiny_fp32
) -> None:
    # Its prompt logprobs weigh one per position: 100 unread positions are past the bound at once.
    prompt = [3 + i % 50 for i in range(100)]
    spec = GenerateSpec(
        [prompt],
        SamplingParams(temperature=0.0, prompt_logprobs=2),
        StoppingParams(max_new_tokens=8, ignore_eos=True),
    )
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        expected = _tokens(_alone(engine, spec))
        reader = engine.generate(spec)
        assert isinstance(next(reader), Accepted)
        _wait_for(lambda: engine.core.scheduler.num_paused == 1)
        assert next(iter(engine.core.scheduler.paused.values())).num_output_tokens == 1
        rest = list(reader)
    assert _tokens(rest) == expected
    assert len(rest[0].prompt_logprobs) == len(prompt)


def test_a_caller_whose_open_streams_hold_too_many_prompt_logprobs_is_refused_until_one_ends(
    tiny_model_dir, tiny_fp32
) -> None:
    def scoring(caller: str) -> GenerateSpec:
        sampling = SamplingParams(temperature=0.0, prompt_logprobs=20)
        return GenerateSpec([[3] * 60], sampling, StoppingParams(max_new_tokens=4), caller=caller)

    with _engine(tiny_model_dir, tiny_fp32) as engine:
        engine.prompt_logprob_budget.max_entries = 2 * 60 * 21  # two such streams per caller
        held = [engine.generate(scoring("a")) for _ in range(2)]
        for reader in held:
            assert isinstance(next(reader), Accepted)  # both admitted, neither read further
        with pytest.raises(ResourceExhausted, match=r"output\.prompt_logprobs.*limit is 2520"):
            next(engine.generate(scoring("a")))
        assert isinstance(next(engine.generate(scoring("b"))), Accepted)  # another caller's budget
        held[0].close()  # the stream ends: its entries come back
        assert isinstance(next(engine.generate(scoring("a"))), Accepted)
        for reader in held[1:]:
            reader.close()
        _wait_for(lambda: engine.core.num_live() == 0)
    assert engine.prompt_logprob_budget.held("a") == 0


def test_a_request_whose_prompt_logprobs_may_not_fit_one_reply_is_refused_before_it_runs(
    tiny_model_dir, tiny_fp32
) -> None:
    def scoring(max_reply_bytes: int | None) -> GenerateSpec:
        sampling = SamplingParams(temperature=0.0, prompt_logprobs=20)
        stopping = StoppingParams(max_new_tokens=1)
        return GenerateSpec([[3] * 60], sampling, stopping, caller="a", max_reply_bytes=max_reply_bytes)

    with _engine(tiny_model_dir, tiny_fp32) as engine:
        fits = engine.prompt_logprob_size.bound([3] * 60, [True] * 60, 20)
        with pytest.raises(InvalidArgument, match=r"--max-message-bytes") as refused:
            next(engine.generate(scoring(fits - 1)))
        assert refused.value.field == "output.prompt_logprobs"
        assert engine.core.num_live() == 0 and engine.prompt_logprob_budget.held("a") == 0
        events = list(engine.generate(scoring(fits)))
        assert isinstance(events[-1], Finished) and len(events[1].prompt_logprobs) == 60
        assert event_to_pb(events[1], engine.token_bytes).ByteSize() <= fits
        unbounded = engine.generate(scoring(None))  # in process: no bound
        assert isinstance(next(unbounded), Accepted)
        unbounded.close()


def _without_chat_template(model_dir: Path, out_dir: Path) -> Path:
    """The checkpoint at `model_dir` with its tokenizer_config.json's chat_template left out."""
    for path in model_dir.iterdir():
        if path.name != "tokenizer_config.json":
            (out_dir / path.name).symlink_to(path)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return out_dir


def test_check_spec_refuses_a_chat_on_a_model_without_a_template_unless_the_chat_brings_one(
    tiny_model_dir, tiny_fp32, tmp_path
) -> None:
    # The servicer runs it before any encoder fetch; the other tests give the servicer their own.
    chat = ChatRequest([ChatMessage("user", [TextPrompt("hi")])])
    with _engine(_without_chat_template(tiny_model_dir, tmp_path), tiny_fp32) as engine:
        with pytest.raises(FailedPrecondition) as error:
            engine.check_spec(GenerateSpec([], chat=chat))
        assert (error.value.field, str(error.value)) == ("chat", str(no_chat_template()))
        engine.check_spec(GenerateSpec([], chat=replace(chat, template="{{ messages[0].content }}")))
