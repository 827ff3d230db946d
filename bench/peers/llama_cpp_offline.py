"""llama.cpp (llama-cpp-python) on the shipped Q4_1 GGUF file: batch-1 decode and TTFT, for context.

Runs inside bench/peers/.venv-llama-cpp (made by llama_cpp.sh), never in Tandem's venv. Prints one
JSON object: {"version": ..., "decode": {"tokens_per_s", "decode_tokens_per_s", "ttft_s", "runs": [...]},
"ttft_s": {length: {"median": s, "runs": [...]}}}.

Prompts are random token IDs below 1000, as in Tandem's benchmark (drawn by numpy here). Decode: one
sequence of `--prompt-len` tokens, then exactly `--new-tokens` greedy tokens (the argmax of the
logits, EOS ignored), each fed back with `eval`; tokens/s end to end (prefill included) and over
the decode steps alone. TTFT: `eval` of the whole prompt plus the first argmax. `Llama` holds one
sequence, so only N = 1 runs: llama.cpp's server batches several, this binding's object does not.

Its weights are 4-bit (Q4_1: about 0.6 bytes per weight with the scales, against bf16's 2), so it
reads about a third of the bytes per decode step: context for Tandem's bf16 rows, not a target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def prompt_ids(prompt_len: int, vocab_size: int, seed: int) -> list[int]:
    # Tandem's distribution (IDs below 1000); numpy draws them, as this venv has no torch.
    return np.random.default_rng(seed).integers(0, min(1000, vocab_size), prompt_len).tolist()


def argmax_last(llm) -> int:
    return int(np.argmax(llm.scores[llm.n_tokens - 1]))


def generate(llm, prompt: list[int], new_tokens: int) -> tuple[float, float, float]:
    """(wall s, TTFT s, decode s) for one greedy sequence of exactly `new_tokens`."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    token = argmax_last(llm)
    first = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([token])
        token = argmax_last(llm)
    end = time.perf_counter()
    return end - start, first - start, end - first


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="the GGUF file")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--ttft-lens", default="128,512,1024,2048,4095")
    p.add_argument(
        "--no-extra-bufts",
        action="store_true",
        help="keep the file's weight layout (llama.cpp's repacked CPU buffers off): its AMX path "
        "segfaulted on a Xeon, and the harness reruns with this when the default run dies",
    )
    args = p.parse_args()
    import llama_cpp

    if args.no_extra_bufts:
        # Not a keyword of Llama(): the model parameters it starts from are llama.cpp's defaults, read
        # through the ctypes bindings module (llama.py does `import llama_cpp.llama_cpp as llama_cpp`).
        # Patching the package's re-export instead left them on: on an AMX Xeon the retry crashed
        # (signal 11) as the default run did; patched here it ran (Q4_1 at 167 tok/s, issue 48).
        import llama_cpp.llama_cpp as bindings

        defaults = bindings.llama_model_default_params

        def without_extra_bufts():
            params = defaults()
            params.use_extra_bufts = False
            return params

        bindings.llama_model_default_params = without_extra_bufts

    lens = [int(n) for n in args.ttft_lens.split(",") if n]
    n_ctx = max([*lens, args.prompt_len + args.new_tokens]) + 16
    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=n_ctx,
        # llama-cpp-python 0.3.36 keeps n_batch rows of scores without logits_all and writes the last
        # prompt token's at its position: a prompt longer than n_batch raised IndexError. llama.cpp
        # still computes in micro-batches (n_ubatch, 512) whatever n_batch is.
        n_batch=n_ctx,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=False,
        verbose=False,
    )
    vocab = llm.n_vocab()
    generate(llm, prompt_ids(args.prompt_len, vocab, 99), 8)  # warm-up
    prompts = [prompt_ids(args.prompt_len, vocab, seed) for seed in range(args.repeats)]
    runs = [generate(llm, prompt, args.new_tokens) for prompt in prompts]
    decode = {
        "tokens_per_s": statistics.median(args.new_tokens / wall for wall, _, _ in runs),
        "decode_tokens_per_s": statistics.median((args.new_tokens - 1) / d for _, _, d in runs),
        "ttft_s": statistics.median(t for _, t, _ in runs),
        "runs": [[round(x, 5) for x in run] for run in runs],
    }
    ttft: dict[int, dict] = {}
    for length in lens:
        times = []
        for repeat in range(-1, args.repeats):
            _, first, _ = generate(llm, prompt_ids(length, vocab, 20_000 + 100 * repeat + length), 1)
            if repeat >= 0:
                times.append(first)
        ttft[length] = {"median": statistics.median(times), "runs": times}
    extra_bufts = not args.no_extra_bufts
    print(
        json.dumps(
            {"version": llama_cpp.__version__, "extra_bufts": extra_bufts, "decode": decode, "ttft_s": ttft}
        )
    )


if __name__ == "__main__":
    main()
