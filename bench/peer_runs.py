"""The peers that run in venvs of their own, each started as a subprocess by the harness.

- vLLM CPU (`bench/peers/.venv-vllm`, made by `bench/peers/vllm_cpu.sh`): decode at N = 1/8/32,
  token or embedding prompts, on the same checkpoint directory as Tandem.
- llama.cpp through llama-cpp-python (`bench/peers/.venv-llama-cpp`, made by
  `bench/peers/llama_cpp.sh`): batch-1 decode and TTFT on the GGUF file the default model ships as
  (Q4_1), 2 threads. Context, not a target: 4-bit weights read about a third of bf16's bytes.

A peer whose venv is missing, or that fails, gives a string saying why instead of numbers; the
report prints it in place of the rows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

PEERS = Path(__file__).resolve().parent / "peers"
VLLM_PYTHON = PEERS / ".venv-vllm" / "bin" / "python"
LLAMA_PYTHON = PEERS / ".venv-llama-cpp" / "bin" / "python"
VLLM_MISSING = "skipped: run bench/peers/vllm_cpu.sh"
LLAMA_MISSING = "skipped: run bench/peers/llama_cpp.sh"


def _json_line(argv: list[str], name: str, timeout_s: int) -> dict | str:
    """The last JSON line the peer printed, or why there is none."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"skipped: {name} did not finish within {timeout_s} s"
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"version"')]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"skipped: {name} exited with {done.returncode}: {last[:200]}"
    return json.loads(lines[-1])


def run_vllm(
    args: argparse.Namespace, model_dir: Path, prompt_embeds: bool, prompt_len: int, new_tokens: int
) -> tuple[dict[int, dict] | str, str | None]:
    """(vLLM's median tokens/s per N as {N: {"median", "runs"}}, or why it was skipped; its version)."""
    if args.skip_vllm:
        return "skipped: --skip-vllm", None
    if not VLLM_PYTHON.exists():
        return VLLM_MISSING, None
    argv = [
        str(VLLM_PYTHON), str(PEERS / "vllm_offline.py"), "--model-dir", str(model_dir),
        "--sizes", ",".join(map(str, args.sizes)), "--repeats", str(args.repeats),
        "--prompt-len", str(prompt_len), "--new-tokens", str(new_tokens),
        *(["--prompt-embeds"] if prompt_embeds else []),
    ]  # fmt: skip
    print(f"  vLLM{' (prompt embeds)' if prompt_embeds else ''}: starting its own process ...", flush=True)
    result = _json_line(argv, "vLLM", 900)
    if isinstance(result, str):
        return result, None
    rates = {
        int(n): {"median": row["tokens_per_s"], "runs": [round(r, 4) for r in row["runs_tokens_per_s"]]}
        for n, row in result["sizes"].items()
    }
    for n, rate in rates.items():
        print(f"  vLLM{'-embeds' if prompt_embeds else ''} N={n:<3} {rate['median']:8.1f} tok/s", flush=True)
    return rates, result["version"]


def run_llama_cpp(
    args: argparse.Namespace, gguf: Path | None, prompt_len: int, new_tokens: int, ttft_lens: list[int]
) -> dict | str:
    """llama.cpp's batch-1 decode and TTFT on `gguf` (see llama_cpp_offline.py), or why it was skipped."""
    if args.skip_llama_cpp:
        return "skipped: --skip-llama-cpp"
    if gguf is None:
        return "skipped: this checkpoint has no GGUF file"
    if not LLAMA_PYTHON.exists():
        return LLAMA_MISSING
    argv = [
        str(LLAMA_PYTHON), str(PEERS / "llama_cpp_offline.py"), "--model", str(gguf),
        "--threads", str(args.threads), "--repeats", str(args.repeats), "--prompt-len", str(prompt_len),
        "--new-tokens", str(new_tokens), "--ttft-lens", ",".join(map(str, ttft_lens)),
    ]  # fmt: skip
    print("  llama.cpp: starting its own process ...", flush=True)
    result = _json_line(argv, "llama-cpp-python", 1800)
    if isinstance(result, str) and "exited with -" in result:  # killed by a signal: a crash, not a refusal
        # llama.cpp's repacked-weight (AMX) path segfaulted on a Xeon: keep the row, without it.
        print(f"  llama.cpp {result.removeprefix('skipped: ')}; again with --no-extra-bufts ...", flush=True)
        crashed = result
        result = _json_line([*argv, "--no-extra-bufts"], "llama-cpp-python", 1800)
        if not isinstance(result, str):
            result["default_run"] = crashed
    if not isinstance(result, str):
        rate, decoding = result["decode"]["tokens_per_s"], result["decode"]["decode_tokens_per_s"]
        print(f"  llama.cpp N=1 {rate:8.1f} tok/s ({decoding:.1f} decoding)", flush=True)
    return result
