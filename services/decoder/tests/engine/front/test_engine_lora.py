"""LoRA adapters in the engine with the rest of a request's options: prompt logprobs are the
adapter's, structured output and chat templates hold with it, --batch-invariant keeps an adapted
request's tokens and logprobs whatever shares its batch, and on the bf16 production path (the fused
C layers and the decode stack) an adapted request's tokens are the same alone, among other adapters'
and speculating."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from services.decoder.tests.lora_adapters import SPECS, make_adapter
from tandem.client.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.chat import ChatMessage, ChatRequest
from tandem.decoder.engine.admission.prompt import GenerateSpec, TextPrompt
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.backpressure import MAX_UNREAD_TOKENS
from tandem.decoder.engine.outputs.outputs import Accepted, Delta, Failed, Finished
from tandem.decoder.engine.params import SamplingParams, StoppingParams, StructuredOutput
from tandem.decoder.engine.scheduling.adapters import Adapter

PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[str, Path], ...]:
    out = tmp_path_factory.mktemp("adapters")
    return tuple(
        (name, make_adapter(tiny_model_dir, out / name, SPECS[name], seed=i))
        for i, name in enumerate(("qv4", "mlp8"))
    )


def engine(model_dir: Path, adapters, **settings) -> Engine:
    settings.setdefault("dtype", "float32")
    config = EngineConfig(
        model_dir=model_dir,
        num_kv_blocks=256,
        block_size=4,
        enable_lora=True,
        loras=adapters,
        **settings,
    )
    return Engine(config).start()


def deltas(e: Engine, spec: GenerateSpec) -> list[Delta]:
    return [event for event in e.generate(spec) if isinstance(event, Delta)]


def spec(adapter: str, **fields) -> GenerateSpec:
    fields.setdefault("prompt", [PROMPT])
    return GenerateSpec(
        sampling=fields.pop("sampling", SamplingParams(temperature=0.0)),
        stopping=StoppingParams(max_new_tokens=8, ignore_eos=fields.pop("ignore_eos", True)),
        adapter=adapter,
        **fields,
    )


def test_prompt_logprobs_are_the_adapters_own(tiny_model_dir: Path, adapters) -> None:
    import peft
    import transformers

    with engine(tiny_model_dir, adapters) as e:
        scored = deltas(e, spec("qv4", sampling=SamplingParams(temperature=0.0, prompt_logprobs=0)))
    got = [entry.logprob for entry in scored[0].prompt_logprobs[1:]]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, dict(adapters)["qv4"])
    with torch.no_grad():
        logprobs = model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    want = [logprobs[i, PROMPT[i + 1]].item() for i in range(len(PROMPT) - 1)]
    assert got == pytest.approx(want, abs=1e-4)


def test_a_chat_with_structured_output_answers_from_the_grammar_with_an_adapter(
    tiny_model_dir: Path, adapters
) -> None:
    chat = ChatRequest(messages=[ChatMessage("user", [TextPrompt("Pick one")])])
    with engine(tiny_model_dir, adapters) as e:
        for adapter in ("qv4", "mlp8", ""):
            text = "".join(
                d.text
                for d in deltas(
                    e,
                    spec(
                        adapter,
                        prompt=[],
                        chat=chat,
                        structured=StructuredOutput("choice", ("red", "green", "blue")),
                        ignore_eos=False,
                    ),
                )
            )
            assert text in ("red", "green", "blue")


def test_batch_invariant_adapted_requests_keep_tokens_and_logprobs_whatever_shares_the_batch(
    tiny_model_dir: Path, adapters
) -> None:
    import threading

    def one(e: Engine, adapter: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
        ds = deltas(e, spec(adapter, sampling=SamplingParams(temperature=0.8, seed=7, logprobs=True)))
        return tuple(t for d in ds for t in d.token_ids), tuple(lp for d in ds for lp in d.logprobs)

    with engine(tiny_model_dir, adapters, batch_invariant=True) as e:
        alone = one(e, "qv4")
        results: list = []
        threads = [
            threading.Thread(target=lambda a=a: results.append((a, one(e, a))))
            for a in ("qv4", "mlp8", "", "qv4")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [r for a, r in results if a == "qv4"] == [alone, alone]
    assert [r for a, r in results if a == "mlp8"][0] != alone


def test_on_the_fused_bf16_path_an_adapted_requests_tokens_are_the_same_alone_among_others_and_speculating(
    tiny_model_dir: Path, adapters
) -> None:
    import threading

    # bf16 on the C kernels: the fused layers and the one-call decode stack add the deltas (float32
    # runs per op). Verify rows take the per-layer fused calls, plain decode steps the stack, and a
    # row's sums do not depend on its neighbours: the same greedy tokens every way.
    def run(e: Engine, adapter: str) -> tuple[list[int], int]:
        stopping = StoppingParams(max_new_tokens=24, ignore_eos=True)
        events = list(
            e.generate(GenerateSpec([PROMPT], SamplingParams(temperature=0.0), stopping, adapter=adapter))
        )
        finished = next(event for event in events if isinstance(event, Finished))
        return [
            t for event in events if isinstance(event, Delta) for t in event.token_ids
        ], finished.proposed_tokens

    def together(e: Engine, names: tuple[str, ...]) -> dict[str, tuple[list[int], int]]:
        results: dict[str, tuple[list[int], int]] = {}
        threads = [threading.Thread(target=lambda a=a: results.update({a: run(e, a)})) for a in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    names = ("qv4", "mlp8", "")
    with engine(tiny_model_dir, adapters, dtype="bfloat16") as e:
        assert e.executor.choice.fused_layers and e.executor.choice.decode_stack
        alone = {name: run(e, name)[0] for name in names}
        shared = together(e, names)
    with engine(tiny_model_dir, adapters, dtype="bfloat16", speculative_tokens=3) as e:
        speculating = together(e, names)
    assert {name: tokens for name, (tokens, _) in shared.items()} == alone
    assert {name: tokens for name, (tokens, _) in speculating.items()} == alone
    assert sum(proposed for _, proposed in speculating.values()) > 0  # verify rows ran with the adapters
    assert alone["qv4"] != alone[""] and alone["mlp8"] != alone[""]  # the adapters change the answer


def test_a_load_needing_the_slot_of_an_unloaded_adapter_whose_requests_wait_for_readers_ends_them(
    tiny_model_dir: Path, adapters
) -> None:
    """A stream nobody reads pauses; once its adapter is unloaded, it keeps the slot while a load finds
    another one free, and a load that needs that slot ends it (FAILED_PRECONDITION naming the unload,
    after the tokens it had) instead of RESOURCE_EXHAUSTED for ever."""
    (qv4, qv4_path), (_, mlp8_path) = adapters
    stopping = StoppingParams(max_new_tokens=3 * MAX_UNREAD_TOKENS, ignore_eos=True)
    with engine(tiny_model_dir, adapters, max_loras=3) as e:
        reader = e.generate(GenerateSpec([PROMPT], SamplingParams(temperature=0.0), stopping, adapter=qv4))
        assert isinstance(next(reader), Accepted)  # then nothing is taken
        deadline = time.monotonic() + 60
        while e.core.scheduler.num_paused == 0:
            assert time.monotonic() < deadline, "never paused"
            time.sleep(0.01)
        assert e.unload_adapter(qv4) == 1
        asyncio.run(e.load_adapter("x", qv4_path))  # a free slot: the slow reader keeps its stream
        assert e.core.scheduler.num_paused == 1
        asyncio.run(e.load_adapter("y", mlp8_path))  # qv4's slot, held by the paused request alone
        assert [a.name for a in e.adapters] == ["mlp8", "x", "y"] and e.core.num_live() == 0
        blocks = e.core.block_manager
        assert blocks.num_free_blocks == blocks.num_total_blocks
        rest = list(reader)
        assert sum(len(event.token_ids) for event in rest if isinstance(event, Delta)) > MAX_UNREAD_TOKENS
        assert isinstance(rest[-1], Failed) and isinstance(rest[-1].error, FailedPrecondition)
        assert "adapter 'qv4' was unloaded while this request was paused" in rest[-1].error.message
        with pytest.raises(ResourceExhausted, match="each holds a loaded adapter: unload one first") as full:
            asyncio.run(e.load_adapter("z", qv4_path))
        assert full.value.retry_after_s is None  # only an UnloadAdapter frees a slot: no retry hint


def test_only_a_load_that_installs_ends_paused_requests_and_two_loads_take_two_such_slots(
    tiny_model_dir: Path, adapters, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that fails on its files ends no paused request (it took no slot), and two loads at once,
    with two draining slots held only by paused requests, both load: each install takes a slot of its
    own (each check had only tested that one could be freed)."""
    (qv4, _), (mlp8, mlp8_path) = adapters
    stopping = StoppingParams(max_new_tokens=3 * MAX_UNREAD_TOKENS, ignore_eos=True)
    with engine(tiny_model_dir, adapters, max_loras=2) as e:
        readers = [
            e.generate(GenerateSpec([PROMPT], SamplingParams(temperature=0.0), stopping, adapter=name))
            for name in (qv4, mlp8)
        ]
        for reader in readers:
            assert isinstance(next(reader), Accepted)  # then nothing is taken
        deadline = time.monotonic() + 60
        while e.core.scheduler.num_paused < 2:
            assert time.monotonic() < deadline, "never paused"
            time.sleep(0.01)
        assert e.unload_adapter(qv4) == 1 and e.unload_adapter(mlp8) == 1
        with pytest.raises(InvalidArgument):
            asyncio.run(e.load_adapter("missing", tmp_path / "missing"))
        assert e.core.scheduler.num_paused == 2 and e.core.num_live() == 2

        # Both loads pass their checks before either installs (the reader thread checks the second
        # while the first waits for the engine thread), as they may when the engine is busy.
        checked = threading.Condition()
        num_checked = 0
        check, queue_install = e.core.check_can_load, e.core.between_steps

        def counted_check(name: str) -> None:
            nonlocal num_checked
            check(name)
            with checked:
                num_checked += 1
                checked.notify_all()

        def install_after_both_checks(fn):
            with checked:
                assert checked.wait_for(lambda: num_checked == 2, timeout=30)
            return queue_install(fn)

        monkeypatch.setattr(e.core, "check_can_load", counted_check)
        monkeypatch.setattr(e.core, "between_steps", install_after_both_checks)

        async def load_two() -> list[Adapter]:
            return await asyncio.gather(e.load_adapter("x", mlp8_path), e.load_adapter("y", mlp8_path))

        assert sorted(a.slot for a in asyncio.run(load_two())) == [0, 1]
        assert e.core.num_live() == 0
        for reader in readers:
            last = list(reader)[-1]
            assert isinstance(last, Failed) and "a LoadAdapter took its slot" in last.error.message
