"""Tandem's benchmark harness (`make bench`, `tandem bench`): every workload and peer in one run.

It starts what it measures (in-process engines, a decoder and an encoder server as subprocesses,
vLLM and llama.cpp in their own venvs) and runs the workloads on two checkpoints, bf16: the default
model, SmolLM2-135M-Instruct (30 layers, hidden 576; the primary benchmark model), then bench-small
(8 random layers, hidden 512). It writes `bench-<date>.json` and `bench-<date>.png` under `--out`.
Workloads, per model:

1. decode throughput at N = 1/8/32 concurrent requests (128 random prompt tokens, 64 greedy tokens,
   EOS ignored): Tandem in-process, Tandem over gRPC, transformers `generate`, vLLM CPU, and at N = 1
   llama.cpp on the default model's Q4_1 GGUF; tokens/s end to end and over the decode steps alone;
2. the same with each prompt given as its 128 rows of the checkpoint's `embed_tokens` table
   (Tandem `EmbeddingPrompt`, transformers `inputs_embeds`, vLLM `EmbedsPrompt`);
3. time to first token for one prompt of 128..4095 tokens (max_new_tokens 1): Tandem, transformers,
   llama.cpp;
4. prefix cache: TTFT of a fresh 1024-token prompt (miss) and of the same prompt again (hit);
5. on the default model, decode with its GGUF file's own quantized weights (`--quantization gguf`)
   against the bf16 engine, interleaved, with each engine's resident memory; and, in the same
   interleaving, the same weights with 8-bit activations (`--quantized-activations int8`, the
   JSON's `quantized-activations` workload; `--skip-quantized-activations` leaves it out);
and once: 6. embedding transport (`transport.py`); 7. the machine's floors, sampled between the
workloads (`floors.py`).

transformers runs in bf16 where oneDNN has a bf16 matmul and in float32 where it has not (an
AVX2-only CPU, where torch's bf16 matmul is a reference loop): its faster setting on the machine.

Noise: the VM is shared, so in-process engines are warmed up and interleaved (the order rotates per
repeat) and medians are kept; peers in venvs run in subprocesses between them; the load average is
recorded at the start and the end. tokens/s = N x new tokens / wall time, prefill included.

Run: `make bench`, `.venv/bin/python bench/harness.py --quick` (smoke), `--skip-vllm`,
`--skip-llama-cpp`, `--skip-transformers`, `--repeats N`, `--out DIR`, `--model-dir DIR` (that
checkpoint only).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_throughput import ensure_model, make_prompts  # noqa: E402
from floors import Floors, ModelCost, measure_floors  # noqa: E402
from grpc_throughput import run_grpc, start_server, wait_serving  # noqa: E402
from peer_runs import run_llama_cpp, run_vllm  # noqa: E402
from report import print_report, write_plot  # noqa: E402
from subjects import Remote, TandemSubject, TransformersSubject  # noqa: E402
from transport import transport_workload  # noqa: E402

from tandem.common.torch_part.model_cache import default_model_file, resolve_model  # noqa: E402
from tandem.decoder.backends.cpu.isa import best_level, this_cpu  # noqa: E402
from tandem.decoder.backends.cpu.linear import can_prepack  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPT_LEN = 128
NEW_TOKENS = 64
PREFIX_LEN = 1024
TTFT_LENS = (128, 512, 1024, 2048, 4095)  # 4095: bench-small's 4096 positions hold the prompt + 1 token


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke test: N 1,8, one repeat, short prompts")
    p.add_argument("--skip-vllm", action="store_true", help="do not run the vLLM CPU peer")
    p.add_argument("--skip-transformers", action="store_true", help="do not run the transformers peer")
    p.add_argument("--skip-llama-cpp", action="store_true", help="do not run the llama.cpp peer")
    p.add_argument(
        "--skip-quantized-activations",
        action="store_true",
        help="do not run the gguf engine with --quantized-activations int8",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed runs per point, median kept (default 3)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="where JSON and PNG go")
    p.add_argument("--model-dir", type=Path, default=None, help="this checkpoint only (default: both)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    args.sizes = [1, 8] if args.quick else [1, 8, 32]
    args.ttft_lens = TTFT_LENS[:2] if args.quick else TTFT_LENS
    return args


def workload_args(threads: int, prompt_len: int, new_tokens: int) -> argparse.Namespace:
    """The settings decode_throughput.build_engine and grpc_throughput take from their CLIs."""
    return argparse.Namespace(
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        threads=threads,
        max_num_batched_tokens=4096,
        stream_interval=1,
    )


# -- workloads 1 and 2: decode throughput ------------------------------------------------------------


def decode_workload(
    tandem: Remote,
    hf: Remote | None,
    address: str | None,
    embeds: bool,
    vocab: int,
    args: argparse.Namespace,
) -> tuple[dict[str, dict[int, list[float]]], dict[str, dict[int, list[float]]]]:
    """tokens/s runs per engine and N, end to end and decode steps only (where the engine reports its
    first token). With `embeds`, prompts are embedding rows ("-embeds" engines)."""
    suffix = "-embeds" if embeds else ""
    subjects: dict[str, Remote] = {"tandem": tandem} | ({"transformers": hf} if hf is not None else {})
    engines = list(subjects)
    if address is not None:
        engines.insert(1, "tandem-grpc")

    def run(name: str, ids: list[list[int]], new_tokens: int) -> tuple[float, float | None]:
        if name == "tandem-grpc":
            wall, tokens, _ = asyncio.run(run_grpc(address, ids, workload_args(args.threads, 0, new_tokens)))
            return tokens / wall, None
        tokens, wall, _, decode_s = subjects[name].call("run", ids, new_tokens, embeds)
        return tokens / wall, (tokens - len(ids)) / decode_s if decode_s else None

    for n in args.sizes:  # warm-up: first-use allocations, oneDNN primitive caches
        for name in engines:
            run(name, make_prompts(n, PROMPT_LEN, vocab, seed=10_000 + n), 8)
    runs: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    decode_runs: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for repeat in range(args.repeats):
        order = engines[repeat % len(engines) :] + engines[: repeat % len(engines)]
        for n in args.sizes:
            ids = make_prompts(n, PROMPT_LEN, vocab, seed=repeat)
            for name in order:
                rate, decode_rate = run(name, ids, NEW_TOKENS)
                runs[name + suffix][n].append(rate)
                if decode_rate is not None:
                    decode_runs[name + suffix][n].append(decode_rate)
                decoding = f" ({decode_rate:.1f} decoding)" if decode_rate is not None else ""
                print(f"  decode{suffix} repeat {repeat + 1} N={n:<3} {name:<13} {rate:8.1f} tok/s{decoding}",
                      flush=True)  # fmt: skip
    return {k: dict(v) for k, v in runs.items()}, {k: dict(v) for k, v in decode_runs.items()}


# -- workloads 3 and 4: time to first token ----------------------------------------------------------


def ttft_workload(
    tandem: Remote, hf: Remote | None, vocab: int, args: argparse.Namespace
) -> dict[str, dict[int, list[float]]]:
    """TTFT seconds per engine and prompt length: one fresh prompt, max_new_tokens 1."""
    subjects: dict[str, Remote] = {"tandem": tandem} | ({"transformers": hf} if hf is not None else {})
    runs: dict[str, dict[int, list[float]]] = {name: defaultdict(list) for name in subjects}
    for repeat in range(-1, args.repeats):  # repeat -1 warms up every length
        for length in args.ttft_lens:
            prompt = make_prompts(1, length, vocab, seed=20_000 + 100 * repeat + length)
            order = list(runs) if repeat % 2 == 0 else list(runs)[::-1]
            for name in order:
                ttft = subjects[name].call("run", prompt, 1, False)[2]
                if repeat >= 0:
                    runs[name][length].append(ttft)
                    print(f"  TTFT repeat {repeat + 1} len={length:<5} {name:<13} {1e3 * ttft:8.1f} ms")
    return {name: dict(by_len) for name, by_len in runs.items()}


def prefix_workload(tandem: Remote, vocab: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """TTFT seconds of a fresh PREFIX_LEN prompt (miss) and of the same prompt again (hit)."""
    runs: dict[str, list[float]] = {"miss": [], "hit": []}
    for repeat in range(-1, args.repeats):
        prompt = make_prompts(1, PREFIX_LEN, vocab, seed=30_000 + repeat)
        miss = tandem.call("run", prompt, 1, False)[2]
        hit = tandem.call("run", prompt, 1, False)[2]
        if repeat >= 0:
            runs["miss"].append(miss)
            runs["hit"].append(hit)
            print(f"  prefix cache repeat {repeat + 1}: miss {1e3 * miss:7.1f} ms, hit {1e3 * hit:7.1f} ms")
    return runs


# -- main ----------------------------------------------------------------------------------------------


def machine_info() -> dict:
    """The CPU (model name, the ISA flags that decide kernel choices, the kernel build this CPU loads)
    and the software versions: every figure of a run is read against these."""
    import transformers

    cpu = this_cpu()
    return {
        "cpu": cpu.model_name,
        "cpu_isa": cpu.isa_summary,
        "cpu_flags": sorted(cpu.flags),
        "cpu_kernel_build": best_level(cpu).name,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def summarize(runs: dict[str, dict[int, list[float]]]) -> dict[str, dict[int, dict]]:
    return {
        name: {k: {"median": statistics.median(v), "runs": [round(x, 4) for x in v]} for k, v in by_k.items()}
        for name, by_k in runs.items()
    }


INT8_ACTIVATIONS = "tandem-gguf-int8"  # the gguf engine with --quantized-activations int8


def quantized_workload(
    dense: Remote, model_dir: Path, gguf: Path, vocab: int, args: argparse.Namespace
) -> tuple[dict, dict | None]:
    """Token-prompt decode at each N with the GGUF file's own quantized weights (`--quantization
    gguf`) against the bf16 engine `dense`, interleaved per repeat, each engine's resident memory, and
    the quantized weights' TTFT on an engine set up as the bf16 TTFT engine (the report reads both
    beside llama.cpp's on the same file). Unless --skip-quantized-activations, the same weights with
    8-bit activations run in the same interleaving: (the gguf workload, the `quantized-activations`
    one or None), each in the same form."""
    settings = (model_dir, workload_args(args.threads, PROMPT_LEN, NEW_TOKENS), max(args.sizes), False, gguf)
    quantized = Remote(TandemSubject, *settings)
    engines = {"tandem": dense, "tandem-gguf": quantized}
    if not args.skip_quantized_activations:
        engines[INT8_ACTIVATIONS] = Remote(TandemSubject, *settings, "int8")
    runs: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    decode_runs: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    try:
        for n in args.sizes:  # warm-up
            for engine in engines.values():
                engine.call("run", make_prompts(n, PROMPT_LEN, vocab, seed=10_000 + n), 8, False)
        for repeat in range(args.repeats):
            order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
            for n in args.sizes:
                ids = make_prompts(n, PROMPT_LEN, vocab, seed=repeat)
                for name in order:
                    tokens, wall, _, decode_s = engines[name].call("run", ids, NEW_TOKENS, False)
                    runs[name][n].append(tokens / wall)
                    if decode_s:
                        decode_runs[name][n].append((tokens - len(ids)) / decode_s)
                    print(
                        f"  quantized repeat {repeat + 1} N={n:<3} {name:<12} {tokens / wall:8.1f} tok/s",
                        flush=True,
                    )
        rss = {name: engine.call("rss_mb") for name, engine in engines.items()}
    finally:
        for name, engine in engines.items():
            if name != "tandem":
                engine.close()
    # TTFT on an engine set up as the bf16 TTFT engine is (its step budget holds the longest prompt
    # whole), so the two compare; the decode engine's smaller budget chunks a long prompt.
    ttft_args = workload_args(args.threads, max(*args.ttft_lens, PREFIX_LEN), 1)
    workloads = {}
    for name, activations in (("tandem-gguf", "none"), (INT8_ACTIVATIONS, "int8")):
        if name not in engines:
            continue
        print(f"time to first token, --quantization gguf, {activations} activations ...", flush=True)
        ttft_engine = Remote(TandemSubject, model_dir, ttft_args, 1, True, gguf, activations)
        try:
            ttft = ttft_workload(ttft_engine, None, vocab, args)["tandem"]  # beside llama.cpp's, same file
        finally:
            ttft_engine.close()
        names = ("tandem", "tandem-gguf") if name == "tandem-gguf" else (name,)
        workloads[name] = {
            "decode_tok_s": summarize({n: runs[n] for n in names}),
            "decode_only_tok_s": summarize({n: decode_runs[n] for n in names if n in decode_runs}),
            "rss_mb": {n: rss[n] for n in names},
            "ttft_s": {length: {"median": statistics.median(v), "runs": v} for length, v in ttft.items()},
        }
    return workloads["tandem-gguf"], workloads.get(INT8_ACTIVATIONS)


def models_to_run(args: argparse.Namespace) -> list[tuple[str, Path, Path | None]]:
    """(label, checkpoint directory, GGUF file of the same model or None), primary model first."""
    if args.model_dir is not None:
        return [(args.model_dir.name, ensure_model(args.model_dir), None)]
    return [
        ("SmolLM2-135M-Instruct", resolve_model(None, "bfloat16"), default_model_file()),
        ("bench-small", ensure_model(None), None),
    ]


def run_model(
    model_dir: Path, gguf: Path | None, args: argparse.Namespace, floor_samples: list[Floors]
) -> tuple[dict, str | None]:
    """Every per-model workload on one checkpoint; (its JSON section, vLLM's version if it ran)."""
    decode_engine = Remote(
        TandemSubject, model_dir, workload_args(args.threads, PROMPT_LEN, NEW_TOKENS), max(args.sizes), False
    )
    shape = decode_engine.call("info")
    vocab = shape["vocab_size"]
    cost = ModelCost(
        params=shape["params"],
        lm_head_params=shape["vocab_size"] * shape["hidden_size"],
        attention_width=shape["num_heads"] * shape["head_dim"],
        num_layers=shape["num_layers"],
    )
    hf_dtype = "bfloat16" if can_prepack(torch.zeros(1, dtype=torch.bfloat16)) else "float32"
    hf = None if args.skip_transformers else Remote(TransformersSubject, model_dir, args.threads, hf_dtype)
    server, address = start_server(
        model_dir, workload_args(args.threads, PROMPT_LEN, NEW_TOKENS), max(args.sizes)
    )
    try:
        asyncio.run(wait_serving(address, server))
        floor_samples.append(measure_floors())
        print("decode throughput, token prompts ...", flush=True)
        decode, decode_only = decode_workload(decode_engine, hf, address, False, vocab, args)
    finally:
        server.terminate()
        server.wait(timeout=60)
    floor_samples.append(measure_floors())
    peers: dict[str, dict | str] = {}
    peers["vllm"], vllm_version = run_vllm(args, model_dir, False, PROMPT_LEN, NEW_TOKENS)
    quantized = activations = None
    if gguf is not None:
        print("decode throughput, --quantization gguf against bf16 weights ...", flush=True)
        quantized, activations = quantized_workload(decode_engine, model_dir, gguf, vocab, args)
    print("decode throughput, embedding prompts ...", flush=True)
    embeds, embeds_only = decode_workload(decode_engine, hf, None, True, vocab, args)
    floor_samples.append(measure_floors())
    peers["vllm-embeds"], embeds_version = run_vllm(args, model_dir, True, PROMPT_LEN, NEW_TOKENS)
    llama = run_llama_cpp(args, gguf, PROMPT_LEN, NEW_TOKENS, list(args.ttft_lens))
    decode_engine.close()
    ttft_engine = Remote(
        TandemSubject, model_dir, workload_args(args.threads, max(*args.ttft_lens, PREFIX_LEN), 1), 1, True
    )
    print("time to first token ...", flush=True)
    ttft = ttft_workload(ttft_engine, hf, vocab, args)
    print("prefix cache ...", flush=True)
    prefix = prefix_workload(ttft_engine, vocab, args)
    ttft_engine.close()
    if hf is not None:
        hf.close()
    floor_samples.append(measure_floors())
    section = {
        "settings": {
            "model": str(model_dir),
            "cost": asdict(cost),
            "transformers_dtype": hf_dtype,
            "gguf": None if gguf is None else str(gguf),
        },  # fmt: skip
        "decode_tok_s": summarize(decode | embeds) | peers,
        "decode_only_tok_s": summarize(decode_only | embeds_only),
        "ttft_s": summarize(ttft),
        "prefix_cache_ttft_s": {k: {"median": statistics.median(v), "runs": v} for k, v in prefix.items()},
        "llama_cpp": llama,
        "quantized": quantized,
    }
    if activations is not None:
        section["quantized-activations"] = activations
    return section, vllm_version or embeds_version


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = datetime.datetime.now()
    info = machine_info() | {"loadavg_start": os.getloadavg()}
    models = models_to_run(args)
    print(f"{info}; models {[str(m) for _, m, _ in models]}", flush=True)
    floor_samples: list[Floors] = []
    sections: dict[str, dict] = {}
    vllm_version = None
    for label, model_dir, gguf in models:
        print(f"== {label} ({model_dir})", flush=True)
        sections[label], version = run_model(model_dir, gguf, args, floor_samples)
        vllm_version = vllm_version or version
    print("embedding transport ...", flush=True)
    primary = models[0][1]
    config = json.loads((primary / "config.json").read_text())
    transport = transport_workload(primary, config["hidden_size"], config["vocab_size"], args.repeats)
    floor_samples.append(measure_floors())
    info |= {
        "loadavg_end": os.getloadavg(),
        "vllm": vllm_version,
        "wall_s": (datetime.datetime.now() - started).total_seconds(),
    }
    payload = {
        "date": started.isoformat(timespec="seconds"),
        "machine": info,
        "settings": {
            "dtype": "bfloat16",
            "threads": args.threads,
            "sizes": args.sizes,
            "prompt_len": PROMPT_LEN,
            "new_tokens": NEW_TOKENS,
            "ttft_lens": list(args.ttft_lens),
            "prefix_len": PREFIX_LEN,
            "repeats": args.repeats,
            "quick": args.quick,
        },
        "floors": [f.as_dict() for f in floor_samples],
        "models": sections,
        "transport": transport,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{started:%Y-%m-%d}" + ("-quick" if args.quick else "")
    payload["summary"] = print_report(payload)
    json_path = args.out / f"{stem}.json"
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    write_plot(payload, args.out / f"{stem}.png")
    print(f"wrote {json_path} and {stem}.png")


if __name__ == "__main__":
    main()
