"""A neighbour's latency beside a flood, for each `--shared-step-seqs` (issue 32's "fair service").

The decoder runs as a process with its defaults on the default model (SmolLM2); for each setting:
the neighbour's 32 greedy tokens alone (a warm-up, then the median of 3), then a flood of N streams
of 1,024 tokens over C connections (each connection one caller) that this process reads on
background threads, counting their tokens, and, once the flood has run 30 s, the neighbour again,
3 times back to back: its time to the first token and to the last, and the flood's tokens/s over
those runs (what narrowing the steps costs it). A reader that keeps up and one that never reads
look the same to the scheduler until the pause (1,024 one-token messages fit in a client's HTTP/2
window), so reading the flood changes nothing but lets this count its tokens.

    .venv/bin/python bench/neighbour_beside_flood.py [--settings 0,16,8] [--streams 640 --connections 20]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hostile_callers import _request, _start  # noqa: E402

from tandem.client.pb.tandem.v1 import decoder_pb2_grpc  # noqa: E402
from tandem.decoder.backends.cpu.isa import this_cpu  # noqa: E402


def neighbour(stub: decoder_pb2_grpc.DecoderStub) -> tuple[float, float]:
    """(seconds to the first token, seconds to the 32nd) of one greedy request."""
    start, first = time.monotonic(), None
    tokens = 0
    for response in stub.Generate(_request("An unrelated request", max_new_tokens=32), timeout=600):
        if response.delta.token_ids and first is None:
            first = time.monotonic() - start
        tokens += len(response.delta.token_ids)
    assert tokens == 32, tokens
    return first or 0.0, time.monotonic() - start


class Flood:
    """`streams` Generate calls over `connections` connections, each read as it comes (grpc.aio, on a
    thread of its own), its tokens counted."""

    def __init__(self, address: str, streams: int, connections: int) -> None:
        self.tokens = 0
        self.loop = asyncio.new_event_loop()
        self.done = threading.Event()
        self.thread = threading.Thread(
            target=self.loop.run_until_complete, args=(self._run(address, streams, connections),), daemon=True
        )
        self.thread.start()

    async def _run(self, address: str, streams: int, connections: int) -> None:
        options = [("grpc.use_local_subchannel_pool", 1)]  # else channels to one target share one
        channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(connections)]
        request = _request(max_new_tokens=1024)
        calls = [
            decoder_pb2_grpc.DecoderStub(channels[i % connections]).Generate(request, timeout=900)
            for i in range(streams)
        ]
        readers = [asyncio.ensure_future(self._read(call)) for call in calls]
        while not self.done.is_set():
            await asyncio.sleep(0.1)
        for call in calls:
            call.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        for channel in channels:
            await channel.close()

    async def _read(self, call) -> None:
        async for response in call:
            self.tokens += len(response.delta.token_ids)

    def close(self) -> None:
        self.done.set()
        self.thread.join(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--settings", default="0,16,8", help="--shared-step-seqs values (0: off)")
    parser.add_argument("--streams", type=int, default=640)
    parser.add_argument("--connections", type=int, default=20)
    parser.add_argument("--warm-s", type=float, default=30.0)
    args = parser.parse_args()
    cpu = this_cpu()
    print(f"CPU: {cpu.model_name} ({cpu.isa_summary}); {platform.node()}")
    print(f"\n{args.streams} flood streams of 1,024 tokens over {args.connections} connections\n")
    print("| --shared-step-seqs | alone (s) | beside the flood (s) | ratio | first token (s) | flood tok/s |")
    print("|---|---|---|---|---|---|")
    for setting in (int(s) for s in args.settings.split(",")):
        flags = ("--shared-step-seqs", str(setting), "--max-queue", "1024")
        process, address = _start("tandem.decoder", None, flags)
        try:
            with grpc.insecure_channel(address) as channel:
                stub = decoder_pb2_grpc.DecoderStub(channel)
                neighbour(stub)  # warm-up
                alone = statistics.median(neighbour(stub)[1] for _ in range(3))
                flood = Flood(address, args.streams, args.connections)
                try:
                    time.sleep(args.warm_s)
                    before, start = flood.tokens, time.monotonic()
                    runs = [neighbour(stub) for _ in range(3)]
                    rate = (flood.tokens - before) / (time.monotonic() - start)
                finally:
                    flood.close()
            beside = statistics.median(r[1] for r in runs)
            first = statistics.median(r[0] for r in runs)
            print(
                f"| {setting or 'off'} | {alone:.2f} | {beside:.2f} | {beside / alone:.1f}x | {first:.2f} "
                f"| {rate:.0f} |",
                flush=True,
            )
        finally:
            process.terminate()
            process.wait(timeout=60)


if __name__ == "__main__":
    main()
