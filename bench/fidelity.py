"""Greedy fidelity of the default model (SmolLM2-135M-Instruct) served with each `--dtype` and
`--quantization`: where each setting's greedy answer first parts from the float32 reference.

Issue 31's rule for quantized serving: with `--dtype float32 --quantization gguf` the greedy tokens
equal transformers' own float32 reading of the GGUF file (tests/integration/test_default_model.py
checks that), and in bf16 the first divergence from that reference comes no earlier than dense
bf16's on the same prompts. Each setting is an engine as `tandem serve decoder` builds it; each
question goes through the checkpoint's chat template and is answered with 32 greedy tokens. The
table gives, per question, the index of the first token that differs from the reference's (32: none
did; a reference that stops at EOS earlier counts as agreeing up to its length), and in brackets
the reference's own margin there: its top token's log-probability minus the runner-up's (a near-tie,
a few hundredths, is where any rounding may pick the other token). Because a first divergence is
decided by such near-ties, each setting also scores the reference's own answers (teacher-forced,
prompt log-probabilities): the mean and largest gap from the reference's log-probability of each
answer token measure how far the setting's numbers are from the reference's, ties or not.

    .venv/bin/python bench/fidelity.py [--settings bfloat16:none,gguf,int8,int4] [--tokens 32]

A setting's `+a8` adds `--quantized-activations int8` (e.g. `gguf+a8`): each row's inputs to the
quantized linears rounded to int8 per 32, a lossy mode read beside the exact one.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from perplexity import Setting  # noqa: E402

from tandem.common.torch_part.model_cache import default_model_file, resolve_model  # noqa: E402
from tandem.common.torch_part.prompt_parts import PromptPart, TextPrompt  # noqa: E402
from tandem.decoder.backends.cpu.isa import this_cpu  # noqa: E402
from tandem.decoder.config import EngineConfig  # noqa: E402
from tandem.decoder.engine.admission.chat import ChatMessage, ChatRequest, ChatTemplate  # noqa: E402
from tandem.decoder.engine.admission.prompt import GenerateSpec  # noqa: E402
from tandem.decoder.engine.front.engine import Engine  # noqa: E402
from tandem.decoder.engine.outputs.outputs import Delta  # noqa: E402
from tandem.decoder.engine.params import SamplingParams, StoppingParams  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "How do I reverse a list in Python?",
    "Give me three tips for sleeping better.",
]
REFERENCE = "float32:gguf"  # the file's own values in float32: what transformers' GGUF load computes
DEFAULT_SETTINGS = "bfloat16:none,gguf,gguf+a8,int8,int4"


def chat_prompts(model_dir: Path, questions: list[str]) -> list[list[PromptPart]]:
    """Each question as one user turn through the checkpoint's chat template, as the engine renders a
    chat request, ready for the answer."""
    template = ChatTemplate.load(model_dir, Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    try:
        return [
            [part for _, part in template.render(ChatRequest([ChatMessage("user", [TextPrompt(q)])]))]
            for q in questions
        ]
    finally:
        template.close()


@dataclass
class Served:
    """One setting's run: per question its greedy tokens, the margin at each (its log-probability minus
    the runner-up's), and the log-probabilities it gives the reference's answer, teacher-forced."""

    tokens: list[list[int]]
    margins: list[list[float]]
    scores: list[list[float]]


def serve(setting: Setting, questions: list[str], tokens: int, reference: list[list[int]] | None) -> Served:
    """Each question answered by the engine `setting` builds, and the reference's answers scored
    (prompt log-probabilities of the answer's positions; its own answers when `reference` is None)."""
    model_dir = resolve_model(None, setting.dtype)
    config = EngineConfig(
        model_dir=model_dir,
        dtype=setting.dtype,
        quantization=setting.quantization,
        quantized_from=default_model_file() if setting.quantization == "gguf" else None,
        quantization_group_size=setting.group_size,
        quantized_activations=setting.activations,
        num_kv_blocks=64,
    )
    engine = Engine(config).start()
    served = Served([], [], [])
    try:
        for q, prompt in enumerate(chat_prompts(model_dir, questions)):
            spec = GenerateSpec(
                prompt,
                SamplingParams(temperature=0.0, top_logprobs=2),
                StoppingParams(max_new_tokens=tokens),
            )
            deltas = [e for e in engine.generate(spec) if isinstance(e, Delta)]
            served.tokens.append([t for d in deltas for t in d.token_ids])
            served.margins.append([t.logprobs[0] - t.logprobs[1] for d in deltas for t in d.top_logprobs])
            answer = served.tokens[-1] if reference is None else reference[q]
            spec = GenerateSpec(
                [*prompt, answer],
                SamplingParams(temperature=0.0, prompt_logprobs=0),
                StoppingParams(max_new_tokens=1),
            )
            positions = [p for e in engine.generate(spec) if isinstance(e, Delta) for p in e.prompt_logprobs]
            served.scores.append([p.logprob for p in positions[len(positions) - len(answer) :]])
        return served
    finally:
        engine.shutdown()


def first_divergence(reference: list[int], tokens: list[int]) -> int:
    """Index of the first token that differs (len(reference) when tokens agree as far as it goes)."""
    return next(
        (i for i, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a != b), len(reference)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--settings", default=DEFAULT_SETTINGS, help="comma-separated [DTYPE:]QUANT[+a8][:GROUP]"
    )
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    cpu = this_cpu()
    print(f"CPU: {cpu.model_name} ({cpu.isa_summary}); reference {REFERENCE}", flush=True)
    reference = serve(Setting.parse(REFERENCE), QUESTIONS, args.tokens, None)
    header = " | ".join(f"q{i + 1}" for i in range(len(QUESTIONS)))
    print(f"\n| setting | {header} | in all | mean / max abs logprob gap, teacher-forced |")
    print("|---|" + "---|" * (len(QUESTIONS) + 2))
    for setting in map(Setting.parse, args.settings.split(",")):
        served = serve(setting, QUESTIONS, args.tokens, reference.tokens)
        parts = [first_divergence(r, t) for r, t in zip(reference.tokens, served.tokens, strict=True)]
        cells = [
            str(i) if i == len(r) else f"{i} ({m[i]:.3f})"
            for i, r, m in zip(parts, reference.tokens, reference.margins, strict=True)
        ]
        gaps = [
            abs(a - b)
            for r, t in zip(reference.scores, served.scores, strict=True)
            for a, b in zip(r, t, strict=True)
        ]
        print(
            f"| {setting.label} | "
            + " | ".join(cells)
            + f" | {sum(parts)} | {sum(gaps) / len(gaps):.4f} / {max(gaps):.4f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
