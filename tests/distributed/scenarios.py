"""What each rank runs in the distributed tests, and the same thing on one rank for the reference.

Kept apart from the test modules so spawned ranks import only this (no pytest, no transformers).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from services.decoder.tests.engine.engine_helpers import run_concurrently
from services.decoder.tests.models.helpers import PagedAllocator
from tandem.common.memory_limit import MemoryLimit
from tandem.decoder.config import EngineConfig
from tandem.decoder.distributed.parallel import ParallelContext
from tandem.decoder.distributed.worker import run_steps
from tandem.decoder.engine.admission.chat import ChatTemplate
from tandem.decoder.engine.admission.prompt import EmbeddingPrompt, GenerateSpec, TextPrompt
from tandem.decoder.engine.front import core_assembly
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Delta, Failed, OutputOptions
from tandem.decoder.engine.params import SamplingParams, StoppingParams
from tandem.decoder.engine.step.batch import StepBatch
from tandem.decoder.engine.step.kv_pool_agreement import KvPoolRefused
from tandem.decoder.engine.step.runner import ModelRunner
from tandem.decoder.engine.step.sequence_parallel import pad_for_sequence_parallel
from tandem.decoder.models import kv_pool
from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.loader import load_model
from tandem.decoder.models.transformer import DecoderModel

Chunk = tuple[str, list[int], torch.Tensor | None]  # sequence key, token ids, rows [n, hidden] or None


def _script(hidden_size: int) -> list[list[Chunk]]:
    """Prefill steps: token, embedding-only and mixed prompts packed together (19 tokens: odd), then
    a chunked prefill sharing steps with the others' decodes. Decode steps are appended by the runner.
    """
    gen = torch.Generator().manual_seed(7)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 1000, (n,), generator=gen).tolist()

    def rows(n: int) -> torch.Tensor:
        return torch.randn(n, hidden_size, generator=gen) * 0.5

    mixed = rows(4)
    long = ids(12)
    return [
        [("tok", ids(7), None), ("mix", [0] * 4 + ids(3), mixed), ("emb", [0] * 5, rows(5))],
        [("long", long[:5], None)],
        [("long", long[5:], None)],
    ]


def _batch(alloc: PagedAllocator, chunks: list[tuple[str, list[int], torch.Tensor | None]], hidden: int):
    starts = [alloc.seq_lens.get(key, 0) for key, _, _ in chunks]
    attn = alloc.metadata([(key, len(ids)) for key, ids, _ in chunks])
    input_ids = [t for _, ids, _ in chunks for t in ids]
    positions = [p for s, (_, ids, _) in zip(starts, chunks, strict=True) for p in range(s, s + len(ids))]
    inputs_embeds = is_token_ids = None
    if any(rows is not None for _, _, rows in chunks):
        inputs_embeds = torch.zeros(len(input_ids), hidden)
        is_token_ids = torch.ones(len(input_ids), dtype=torch.bool)
        offset = 0
        for _, ids, rows in chunks:
            if rows is not None:
                inputs_embeds[offset : offset + rows.shape[0]] = rows
                is_token_ids[offset : offset + rows.shape[0]] = False
            offset += len(ids)
    inputs = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.int64),
        attn=attn,
        inputs_embeds=inputs_embeds,
        is_token_ids=is_token_ids,
    )
    return StepBatch(inputs, num_logits=len(chunks))


def scripted_logits(model: DecoderModel, world_size: int, num_decode_steps: int = 3) -> list[torch.Tensor]:
    """Logits of every step of the script, then of greedy decode steps for every sequence."""
    hidden = model.config.hidden_size
    runner = ModelRunner(model, num_blocks=128, block_size=4)
    alloc = PagedAllocator(num_blocks=128, block_size=4)
    outputs: list[torch.Tensor] = []
    last: dict[str, int] = {}
    with torch.inference_mode():
        for step, prefill in enumerate(_script(hidden)):
            # From the second step on, the finished prompts decode in the same step (mixed batches).
            chunks = [(key, [token], None) for key, token in last.items()] if step else []
            chunks += prefill
            batch = pad_for_sequence_parallel(_batch(alloc, chunks, hidden), world_size)
            logits = runner.forward(batch)
            outputs.append(logits)
            for (key, _, _), row in zip(chunks, logits, strict=True):
                if key != "long" or step == 2:
                    last[key] = int(row.argmax())
        for _ in range(num_decode_steps):
            chunks = [(key, [token], None) for key, token in last.items()]
            logits = runner.forward(_batch(alloc, chunks, hidden))
            outputs.append(logits)
            last = {key: int(row.argmax()) for (key, _, _), row in zip(chunks, logits, strict=True)}
    return outputs


def rank_scripted_logits(tp: ParallelContext, model_dir: Path) -> list[torch.Tensor]:
    model = load_model(model_dir, dtype="float32", tp=tp).model
    return scripted_logits(model, tp.world_size)


def rank_scripted_logits_each(tp: ParallelContext, model_dirs: list[Path]) -> list[list[torch.Tensor]]:
    """rank_scripted_logits for each model in turn, in one group: spawning the ranks (a fresh
    interpreter importing torch each) costs more than a tiny model's script."""
    return [rank_scripted_logits(tp, model_dir) for model_dir in model_dirs]


def rank_weights_held(tp: ParallelContext, model_dir: Path, dtype: str) -> list[tuple[str, bool, int, int]]:
    """Each parameter this rank loaded: (name, contiguous, bytes of its storage, bytes of its values)."""
    model = load_model(model_dir, dtype=dtype, tp=tp).model
    return [
        (name, p.is_contiguous(), p.untyped_storage().nbytes(), p.numel() * p.element_size())
        for name, p in model.named_parameters()
    ]


def rank_load_error(tp: ParallelContext, model_dir: Path) -> str:
    try:
        load_model(model_dir, dtype="float32", tp=tp)
    except ValueError as e:
        return str(e)
    return ""


def engine_config(model_dir: Path, options: dict[str, Any] | None = None) -> EngineConfig:
    """`options`: other EngineConfig fields (a quantization, say), the same on every rank."""
    # A 16-token budget chunks the longer prompts and mixes prefill chunks with decodes.
    return EngineConfig(
        model_dir=model_dir,
        dtype="float32",
        num_kv_blocks=256,
        block_size=4,
        max_num_batched_tokens=16,
        **(options or {}),
    )


def engine_specs(hidden_size: int) -> list[GenerateSpec]:
    gen = torch.Generator().manual_seed(3)
    prompts = [
        [torch.randint(3, 1000, (9,), generator=gen).tolist()],
        [EmbeddingPrompt(torch.randn(6, hidden_size, generator=gen))],
        [[5, 6], EmbeddingPrompt(torch.randn(3, hidden_size, generator=gen)), TextPrompt("The river runs")],
        [torch.randint(3, 1000, (23,), generator=gen).tolist()],
    ]
    return [
        GenerateSpec(
            prompt=prompt,
            sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5, prompt_logprobs=3),
            stopping=StoppingParams(max_new_tokens=6, ignore_eos=True),
            output=OutputOptions(include_text=False),
        )
        for prompt in prompts
    ]


def engine_outputs(engine: Engine) -> list[tuple[list[int], list[float], list[list[float]], list[float]]]:
    """Each spec's tokens, their logprobs, top-5 logprobs and its prompt's logprobs (each position's own
    where it has a token, then its top 3), all requests in flight together."""
    specs = engine_specs(engine.model_config.hidden_size)
    events = run_concurrently(engine, specs)
    results = []
    for evs in events:
        deltas = [e for e in evs if isinstance(e, Delta)]
        results.append(
            (
                [t for d in deltas for t in d.token_ids],
                [lp for d in deltas for lp in d.logprobs],
                [list(top.logprobs) for d in deltas for top in d.top_logprobs],
                [
                    lp
                    for entry in deltas[0].prompt_logprobs
                    for lp in ([] if entry.logprob is None else [entry.logprob]) + list(entry.top_logprobs)
                ],
            )
        )
    return results


def rank_engine_outputs(tp: ParallelContext, model_dir: Path, options: dict[str, Any] | None = None):
    config = engine_config(model_dir, options)
    if tp.rank != 0:
        run_steps(tp, config)
        return None
    engine = Engine(config, tp=tp).start()
    try:
        return engine_outputs(engine)
    finally:
        engine.shutdown()


def rank_engine_outputs_each(tp: ParallelContext, runs: list[tuple[Path, dict[str, Any] | None]]) -> list:
    """rank_engine_outputs for each (model, options) in turn, in one group: an engine and its workers
    start, serve the specs and stop for each, as a decoder process would; one spawn of the ranks for all."""
    return [rank_engine_outputs(tp, model_dir, options) for model_dir, options in runs]


def rank_pool_refusals(tp: ParallelContext, model_dir: Path, refusing_ranks: list[int]) -> list[str]:
    """For each rank of `refusing_ranks` in turn, a start of the group in which that rank's KV pool is
    refused (its host said to have 1 byte of memory): what each rank's start raised ("started" if none).
    Any error but the agreed refusal (KvPoolRefused) is raised."""
    said = []
    for refusing in refusing_ranks:
        memory_limit = kv_pool.memory_limit
        if tp.rank == refusing:
            kv_pool.memory_limit = lambda: MemoryLimit(1, None)
        try:
            if tp.rank == 0:
                Engine(engine_config(model_dir), tp=tp).shutdown()
            else:
                run_steps(tp, engine_config(model_dir))
            said.append("started")
        except KvPoolRefused as error:  # the agreed refusal, on which every rank exits quietly
            said.append(str(error))
        finally:
            kv_pool.memory_limit = memory_limit
    return said


def greedy_spec(prompt: list[int], num_tokens: int) -> GenerateSpec:
    return GenerateSpec(
        prompt=[prompt],
        sampling=SamplingParams(temperature=0.0),
        stopping=StoppingParams(max_new_tokens=num_tokens, ignore_eos=True),
        output=OutputOptions(include_text=False),
    )


def greedy_tokens(engine: Engine, specs: dict[str, GenerateSpec]) -> dict[str, list[int]]:
    """Each spec's tokens, all in flight together; a failed request fails the caller."""
    events = dict(zip(specs, run_concurrently(engine, list(specs.values())), strict=True))
    failed = [e for evs in events.values() for e in evs if isinstance(e, Failed)]
    assert not failed, failed
    return {
        name: [t for e in evs if isinstance(e, Delta) for t in e.token_ids] for name, evs in events.items()
    }


def rank_lora_tokens(
    tp: ParallelContext | None,
    model_dir: Path,
    adapters: dict[str, Path],
    prompt: list[int],
    num_tokens: int,
    options: dict[str, Any] | None = None,
):
    """Rank 0: the base model's and every adapter's greedy tokens, all in one running batch, twice: the
    first adapter loaded at start (--lora), the second and third by LoadAdapter while the engine runs;
    then the second unloaded and the last loaded into its slot. The other ranks run their worker loop.
    With tp None, the same on one rank: the reference."""
    names = list(adapters)
    config = dataclasses.replace(
        engine_config(model_dir, options),
        enable_lora=True,
        loras=((names[0], adapters[names[0]]),),
        max_loras=len(names) - 1,
        max_lora_rank=16,
    )
    if tp is not None and tp.rank != 0:
        run_steps(tp, config)
        return None
    engine = Engine(config, tp=tp).start()

    def run(served: list[str]) -> dict[str, list[int]]:
        spec = greedy_spec(prompt, num_tokens)
        return greedy_tokens(
            engine, {name: dataclasses.replace(spec, adapter=name) for name in ["", *served]}
        )

    try:
        for name in names[1:-1]:
            asyncio.run(engine.load_adapter(name, str(adapters[name])))
        first = run(names[:-1])
        engine.unload_adapter(names[1])
        asyncio.run(engine.load_adapter(names[-1], str(adapters[names[-1]])))  # into the freed slot
        slots = {adapter.name: adapter.slot for adapter in engine.core.adapters.adapters}
        return first, run([names[0], *names[2:]]), slots
    finally:
        engine.shutdown()


def rank_zero_failures(
    tp: ParallelContext, model_dir: Path, points: list[str], late_s: float
) -> list[tuple[str, float]]:
    """For each point of `points` in turn, a start of the group in which rank 0 fails there ("template":
    loading its chat template, before the KV pool's agreement; "core": building its step core, after
    it), rank 1 starting each `late_s` late (a slower load). Each rank's outcome of each start (what
    it raised) with its seconds; then rank 0's word sent within 0.1 s to rank 1 taking it `late_s`
    late: what each got, with rank 0's seconds; then every rank's rank gathered on the control group,
    where a stray message would be read."""
    outcomes: list[tuple[str, float]] = []
    for point in points:
        config = engine_config(model_dir)
        start = time.monotonic()
        try:
            if tp.rank == 0:
                with _rank_zero_failing_at(point):
                    Engine(config, tp=tp)
            else:
                time.sleep(late_s)
                run_steps(tp, config)
            outcomes.append(("started", time.monotonic() - start))
        except Exception as error:
            outcomes.append((f"{type(error).__name__}: {error}", time.monotonic() - start))
    word = torch.tensor([7 if tp.rank == 0 else 0])
    start = time.monotonic()
    try:
        if tp.rank != 0:
            time.sleep(late_s)
        said = str(tp.control.broadcast(word, within_s=0.1).tolist())
    except TimeoutError as error:
        said = f"TimeoutError: {error}"
    outcomes.append((said, time.monotonic() - start))
    ranks = tp.all_gather_control(torch.tensor([tp.rank])).flatten().tolist()
    return [*outcomes, (str(ranks), 0.0)]


@contextlib.contextmanager
def _rank_zero_failing_at(point: str) -> Iterator[None]:
    """Rank 0's set-up raises at `point`."""

    def refuse(*_: object, **__: object) -> None:
        raise RuntimeError(f"injected at {point}")

    saved = (ChatTemplate.__dict__["load"], core_assembly.EngineCore)
    if point == "template":
        ChatTemplate.load = refuse  # type: ignore[method-assign,assignment]
    if point == "core":
        core_assembly.EngineCore = refuse  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        ChatTemplate.load, core_assembly.EngineCore = saved  # type: ignore[misc]
