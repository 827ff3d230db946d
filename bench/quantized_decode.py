"""The harness's quantized workloads alone, on the default model (SmolLM2-135M-Instruct): bf16
weights, the GGUF file's own quantized weights (`--quantization gguf`) and the same with 8-bit
activations (`--quantized-activations int8`), interleaved per repeat in warmed-up engines of their
own (`harness.quantized_workload`), then llama.cpp at N = 1 on the same file (`peer_runs`), and the
report's tables for them. A `make bench` run holds the same figures among the rest; this is the
half hour it takes cut to the part these settings change.

    .venv/bin/python bench/quantized_decode.py [--repeats 5] [--skip-llama-cpp] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    NEW_TOKENS,
    PROMPT_LEN,
    machine_info,
    parse_args,
    quantized_workload,
    workload_args,
)
from peer_runs import run_llama_cpp  # noqa: E402
from report import activations_table, llama_table, quantized_table  # noqa: E402
from subjects import Remote, TandemSubject  # noqa: E402

from tandem.common.torch_part.model_cache import default_model_file, resolve_model  # noqa: E402


def main() -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--json", type=Path, default=None, help="write the figures here")
    known, rest = extra.parse_known_args()
    args = parse_args(rest)
    torch.set_num_threads(args.threads)
    info = machine_info() | {"loadavg_start": os.getloadavg()}
    print({k: v for k, v in info.items() if k != "cpu_flags"}, flush=True)
    model_dir, gguf = resolve_model(None, "bfloat16"), default_model_file()
    dense = Remote(
        TandemSubject, model_dir, workload_args(args.threads, PROMPT_LEN, NEW_TOKENS), max(args.sizes), False
    )
    try:
        vocab = dense.call("info")["vocab_size"]
        quantized, activations = quantized_workload(dense, model_dir, gguf, vocab, args)
    finally:
        dense.close()
    llama = run_llama_cpp(args, gguf, PROMPT_LEN, NEW_TOKENS, list(args.ttft_lens))
    info["loadavg_end"] = os.getloadavg()
    tables = {"--quantization gguf against bf16 weights": quantized_table(quantized, args.sizes)[0]}
    tables["--quantization gguf against llama.cpp"] = llama_table(quantized, llama, args.ttft_lens)[0]
    if activations is not None:
        table, _ = activations_table(quantized, activations, llama, args.sizes)
        tables["--quantized-activations int8"] = table
    for title, lines in tables.items():
        print(f"\n{title}\n" + "\n".join(lines))
    print(f"\nload average {info['loadavg_start']} at the start, {info['loadavg_end']} at the end")
    if known.json is not None:
        payload = {"machine": info, "quantized": quantized, "quantized-activations": activations,
                   "llama_cpp": llama, "tables": tables}  # fmt: skip
        known.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
