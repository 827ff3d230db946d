"""LoRA adapters in the engine with the rest of a request's options: prompt logprobs are the
adapter's, structured output and chat templates hold with it, --batch-invariant keeps an adapted
request's tokens and logprobs whatever shares its batch, and on the bf16 production path (the fused
C layers and the decode stack) an adapted request's tokens are the same alone, among other adapters'
and speculating."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.chat import ChatMessage, ChatRequest
from tandem.decoder.engine.admission.prompt import GenerateSpec, TextPrompt
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Delta, Finished
from tandem.decoder.engine.params import SamplingParams, StoppingParams, StructuredOutput

PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12]


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
