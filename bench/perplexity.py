"""Perplexity of the default model (SmolLM2-135M-Instruct) served with each `--quantization`, on the
text of bench/passages.py: what rounding the weights costs, measured where the weights are served.

Each setting is an engine as `tandem serve decoder` builds it (the CPU executor and its kernels); every
passage and paragraph is one request that scores its own prompt (`prompt_logprobs`), and the
perplexity is exp of the mean negative log-likelihood over all scored tokens (each text's first token
is not scored: nothing comes before it). The reference is dense float32; dense bf16 is what the
quantized settings are read against.

    .venv/bin/python bench/perplexity.py [--settings none,gguf,int8,int4,int4:128] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from passages import PARAGRAPHS, PASSAGES  # noqa: E402

from tandem.common.torch_part.model_cache import default_model_file, resolve_model  # noqa: E402
from tandem.common.torch_part.prompt_parts import TextPrompt  # noqa: E402
from tandem.decoder.backends.cpu.isa import this_cpu  # noqa: E402
from tandem.decoder.config import EngineConfig  # noqa: E402
from tandem.decoder.engine.admission.prompt import GenerateSpec  # noqa: E402
from tandem.decoder.engine.front.engine import Engine  # noqa: E402
from tandem.decoder.engine.outputs.outputs import Delta, Finished  # noqa: E402
from tandem.decoder.engine.params import SamplingParams, StoppingParams  # noqa: E402

DEFAULT_SETTINGS = "float32:none,none,gguf,int8,int4,int4:64"


@dataclass(frozen=True)
class Setting:
    dtype: str
    quantization: str
    group_size: int = 32
    activations: str = "none"  # --quantized-activations

    @classmethod
    def parse(cls, text: str) -> Setting:
        """ "[DTYPE:]QUANTIZATION[+a8][:GROUP]", e.g. "float32:none", "int4:64", "gguf+a8" (with
        --quantized-activations int8)."""
        parts = text.split(":")
        dtype = parts.pop(0) if parts[0] in ("float32", "bfloat16") else "bfloat16"
        group = int(parts[1]) if len(parts) > 1 else 32
        quantization, _, a8 = parts[0].partition("+")
        if a8 not in ("", "a8"):
            raise ValueError(f"{text}: after + only a8 (int8 activations)")
        return cls(dtype, quantization, group, "int8" if a8 else "none")

    @property
    def label(self) -> str:
        group = f", group {self.group_size}" if self.quantization == "int4" else ""
        activations = ", int8 activations" if self.activations == "int8" else ""
        return f"{self.dtype} {self.quantization}{group}{activations}"


def perplexity(setting: Setting, texts: list[str]) -> tuple[float, int, float]:
    """(perplexity, scored tokens, load seconds) of the engine `setting` builds, over `texts`."""
    gguf = default_model_file()
    config = EngineConfig(
        model_dir=resolve_model(None, setting.dtype),
        dtype=setting.dtype,
        quantization=setting.quantization,
        quantized_from=gguf if setting.quantization == "gguf" else None,
        quantization_group_size=setting.group_size,
        quantized_activations=setting.activations,
        num_kv_blocks=64,
        enable_prefix_caching=False,
    )
    start = time.perf_counter()
    engine = Engine(config).start()
    load_s = time.perf_counter() - start
    nll, scored = 0.0, 0
    try:
        for text in texts:
            spec = GenerateSpec(
                [TextPrompt(text)],
                SamplingParams(temperature=0.0, prompt_logprobs=0),
                StoppingParams(max_new_tokens=1),
            )
            events = list(engine.generate(spec))
            assert isinstance(events[-1], Finished), events[-1]
            logprobs = [p.logprob for e in events if isinstance(e, Delta) for p in e.prompt_logprobs]
            nll -= sum(lp for lp in logprobs if lp is not None)
            scored += sum(lp is not None for lp in logprobs)
    finally:
        engine.shutdown()
    return math.exp(nll / scored), scored, load_s


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--settings", default=DEFAULT_SETTINGS, help="comma-separated [DTYPE:]QUANT[+a8][:GROUP]"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    args = parser.parse_args()
    cpu = this_cpu()
    print(f"CPU: {cpu.model_name} ({cpu.isa_summary})", flush=True)
    texts = PASSAGES + PARAGRAPHS
    results = []
    for setting in map(Setting.parse, args.settings.split(",")):
        ppl, scored, load_s = perplexity(setting, texts)
        results.append({"setting": setting.label, "perplexity": ppl, "tokens": scored, "load_s": load_s})
        print(
            f"  {setting.label:<24} perplexity {ppl:8.4f} over {scored} tokens (load {load_s:.1f} s)",
            flush=True,
        )
    base = next((r["perplexity"] for r in results if r["setting"] == "bfloat16 none"), None)
    print("\n| setting | perplexity | vs dense bf16 |\n|---|---|---|")
    for r in results:
        versus = "" if base is None else f"{100 * (r['perplexity'] / base - 1):+.2f} %"
        print(f"| {r['setting']} | {r['perplexity']:.3f} | {versus} |")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"cpu": cpu.model_name, "cpu_isa": cpu.isa_summary, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
