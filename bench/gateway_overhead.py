"""The OpenAI gateway's cost (issue 35): tokens/s and time to first token through `tandem serve
openai` (the `openai` SDK, server-sent events) against the decoder's gRPC stream directly (the Python
client), at 1 / 8 / 32 concurrent streams, in the same run.

The decoder and the gateway run as `python -m tandem.decoder` / `python -m tandem.cli serve openai`
with their defaults (the default model, bf16) on free loopback ports; this process is only the
client, both paths' clients as lean as they come (the Python gRPC client; aiohttp reading the
server-sent events line by line, not the `openai` SDK, whose parsing would bill this client's CPU,
on the same 2 cores, to the gateway). Each stream: the same prompt, 64 greedy tokens, EOS ignored. Subjects
interleave per repeat, the median of `--repeats` kept. Nothing is asserted.

Run: `.venv/bin/python bench/gateway_overhead.py [--model DIR] [--repeats 3]` (about 3 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.client.client import DecoderClient  # noqa: E402
from tandem.client.pb.tandem.v1 import decoder_pb2  # noqa: E402
from tandem.decoder.backends.cpu.isa import this_cpu  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
NEW_TOKENS = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url_or_check, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if url_or_check():
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise TimeoutError("a service did not become ready")


async def _direct(address: str, n: int) -> tuple[float, float]:
    async with DecoderClient(address) as client:

        async def one() -> float:
            request = decoder_pb2.GenerateRequest(
                plain_text=True, prompt=[decoder_pb2.PromptSegment(text=PROMPT)]
            )
            request.stopping.max_new_tokens = NEW_TOKENS
            request.stopping.ignore_eos = True
            request.sampling.temperature = 0
            start, first = time.perf_counter(), None
            async for response in client.generate(request):
                if response.HasField("delta") and first is None:
                    first = time.perf_counter() - start
            return first or 0.0

        start = time.perf_counter()
        firsts = await asyncio.gather(*(one() for _ in range(n)))
        return n * NEW_TOKENS / (time.perf_counter() - start), statistics.median(firsts)


async def _gateway(base_url: str, n: int) -> tuple[float, float]:
    import aiohttp

    body = {"model": "", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> float:
            start, first = time.perf_counter(), None
            async with session.post(f"{base_url}/completions", json=body) as response:
                async for line in response.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter() - start
            return first or 0.0

        start = time.perf_counter()
        firsts = await asyncio.gather(*(one() for _ in range(n)))
        return n * NEW_TOKENS / (time.perf_counter() - start), statistics.median(firsts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="1,8,32")
    args = parser.parse_args()
    cpu = this_cpu()
    print(f"CPU: {cpu.model_name} [{cpu.isa_summary}]")
    decoder_port, gateway_port = _free_port(), _free_port()
    model = ["--model", str(args.model)] if args.model else []
    decoder = subprocess.Popen(
        [sys.executable, "-m", "tandem.decoder", *model, "--port", str(decoder_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    gateway = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "openai", "--port", str(gateway_port),
         "--decoder-address", f"127.0.0.1:{decoder_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    address, base_url = f"127.0.0.1:{decoder_port}", f"http://127.0.0.1:{gateway_port}/v1"
    try:
        _wait(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{gateway_port}/health", timeout=2).status == 200
        )
        sizes = [int(s) for s in args.sizes.split(",")]
        asyncio.run(_direct(address, 1))  # warm both paths
        asyncio.run(_gateway(base_url, 1))
        runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for repeat in range(args.repeats):
            for n in sizes:
                order = [("gRPC", _direct, address), ("gateway", _gateway, base_url)]
                for name, run, target in order if repeat % 2 == 0 else order[::-1]:
                    runs.setdefault((name, n), []).append(asyncio.run(run(target, n)))
    finally:
        for process in (gateway, decoder):
            process.terminate()
            process.wait(timeout=60)
    header = (
        "| N | gRPC tok/s | gateway tok/s | gateway / gRPC | gRPC TTFT (ms) | gateway TTFT (ms) | added |"
    )
    print("\n" + header)
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        grpc_rate = statistics.median(r for r, _ in runs[("gRPC", n)])
        http_rate = statistics.median(r for r, _ in runs[("gateway", n)])
        grpc_ttft = statistics.median(t for _, t in runs[("gRPC", n)]) * 1000
        http_ttft = statistics.median(t for _, t in runs[("gateway", n)]) * 1000
        ratio = http_rate / grpc_rate
        print(
            f"| {n} | {grpc_rate:.1f} | {http_rate:.1f} | **{ratio:.2f}x** | {grpc_ttft:.0f} | "
            f"{http_ttft:.0f} | {http_ttft - grpc_ttft:+.0f} ms |"
        )


if __name__ == "__main__":
    main()
