"""Decode throughput through gRPC streaming against the in-process engine, same workload, same run.

The decode workload of `decode_throughput.py` (bench-small bf16, N concurrent requests of
`--prompt-len` random token IDs, exactly `--new-tokens` greedy tokens) three ways:
- in-process: Tandem's Engine in this process (as in decode_throughput.py);
- gRPC: a `python -m tandem.decoder` subprocess with the same engine settings, driven by N
  concurrent `Generate` streams from an asyncio client in this process (text omitted, as in-process).
Client and server share the machine's cores, so the client's CPU seconds are reported beside the
server's. Target (issue 5): gRPC at least 0.9x the in-process throughput at 32 streams.

Run: `.venv/bin/python bench/grpc_throughput.py --sizes 1,8,32 --repeats 3`.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_throughput import (  # noqa: E402
    BLOCK_SIZE,
    build_engine,
    ensure_model,
    make_prompts,
    num_kv_blocks,
    run_tandem,
    token_budget,
)

from tandem.client.client import DecoderClient, EncoderClient  # noqa: E402
from tandem.client.pb.tandem.v1 import decoder_pb2, tensor_pb2  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,8,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--stream-interval", type=int, default=1, help="steps per delta message")
    p.add_argument("--model-dir", type=Path, default=None)
    return p.parse_args()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, in clock ticks of 10 ms


def start_server(
    model_dir: Path, args: argparse.Namespace, max_requests: int
) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    num_blocks = num_kv_blocks(args, max_requests)  # the in-process engine's settings, as flags
    argv = [
        sys.executable, "-m", "tandem.decoder", "--model", str(model_dir), "--port", str(port),
        "--dtype", "bfloat16", "--max-num-seqs", str(max(32, max_requests)),
        "--max-num-batched-tokens", str(token_budget(args.max_num_batched_tokens, max_requests, num_blocks)),
        "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(num_blocks),
        "--enable-prefix-caching", "false", "--num-threads", str(args.threads),
    ]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return process, f"127.0.0.1:{port}"


async def run_grpc(
    address: str, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[float, int, float]:
    """(wall seconds, generated tokens, median TTFT seconds as the server measured it)."""
    async with DecoderClient(address) as client:

        async def one(prompt: list[int]) -> decoder_pb2.Finished:
            request = decoder_pb2.GenerateRequest(
                prompt=[decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=prompt))]
            )
            request.sampling.temperature = 0.0
            request.stopping.max_new_tokens = args.new_tokens
            request.stopping.ignore_eos = True
            request.output.omit_text = True
            request.output.stream_interval = args.stream_interval
            finished = None
            async for response in client.generate(request, timeout=600):
                if response.HasField("finished"):
                    finished = response.finished
            assert finished is not None
            return finished

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - start
    return (
        wall,
        sum(f.usage.output_tokens for f in results),
        statistics.median(f.time_to_first_token_s for f in results),
    )


async def wait_serving(
    address: str, process: subprocess.Popen, client_type: type[DecoderClient | EncoderClient] = DecoderClient
) -> None:
    """Poll the health service until the server in `process` reports SERVING."""
    async with client_type(address) as client:
        for _ in range(600):
            if process.poll() is not None:
                raise SystemExit(f"the server exited with {process.returncode}")
            try:
                if await client.health(timeout=1) == 1:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
    raise SystemExit("the server never became SERVING")


def main() -> None:
    args = parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    model_dir = ensure_model(args.model_dir)
    process, address = start_server(model_dir, args, max(sizes))
    engine = build_engine(model_dir, args, max(sizes))
    try:
        asyncio.run(wait_serving(address, process))
        vocab = engine.model_config.vocab_size
        warm = make_prompts(2, args.prompt_len, vocab, seed=99)
        run_tandem(engine, warm, 4)
        asyncio.run(run_grpc(address, warm, args))
        rows = []
        for n in sizes:
            local, remote, client_cpu, server_cpu = [], [], [], []
            for repeat in range(args.repeats):
                prompts = make_prompts(n, args.prompt_len, vocab, seed=repeat)
                result, _ = run_tandem(engine, prompts, args.new_tokens)
                local.append(result.tokens / result.wall_s)
                cpu0, server0 = time.process_time(), _cpu_seconds(process.pid)
                wall, tokens, _ = asyncio.run(run_grpc(address, prompts, args))
                client_cpu.append(time.process_time() - cpu0)
                server_cpu.append(_cpu_seconds(process.pid) - server0)
                remote.append(tokens / wall)
            row = (n, statistics.median(local), statistics.median(remote), statistics.median(client_cpu),
                   statistics.median(server_cpu))  # fmt: skip
            rows.append(row)
            print(
                f"N={n:3d}  in-process {row[1]:8.1f} tok/s   gRPC {row[2]:8.1f} tok/s   "
                f"ratio {row[2] / row[1]:.2f}   client CPU {row[3]:.2f} s   server CPU {row[4]:.2f} s",
                flush=True,
            )
        print("\n| N | in-process tok/s | gRPC tok/s | gRPC / in-process | client CPU s | server CPU s |")
        print("|---|---|---|---|---|---|")
        for n, a, b, c, s in rows:
            print(f"| {n} | {a:.1f} | {b:.1f} | {b / a:.2f} | {c:.2f} | {s:.2f} |")
    finally:
        engine.shutdown()
        process.terminate()
        process.wait(timeout=60)


if __name__ == "__main__":
    main()
