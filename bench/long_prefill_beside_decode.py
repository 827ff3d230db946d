"""A decoding neighbour's worst gap while a long prompt prefills, for each `--long-prefill-token-threshold`.

A decoder process per setting, each with its defaults on the default model (SmolLM2) but the
threshold, all started at once (an idle one costs nothing) and measured in turns, so that a loaded
machine's swings fall on every setting alike. After a warm-up, `--repeats` rounds, each of every
setting in turn: a fresh prompt of `--prompt-tokens` random token ids (`max_new_tokens` 1, so its time
is its prefill) alone, then another beside a greedy stream that is already decoding: the long
prompt's time (send to `finished`), and the neighbour's largest gap between two tokens meanwhile and
its median gap. Every prompt is new, so the prefix cache never serves one. `off` starts the decoder
without the flag (a build that predates it, or its default).

    .venv/bin/python bench/long_prefill_beside_decode.py [--settings 0,256,512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hostile_callers import _request, _start  # noqa: E402

from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, tensor_pb2  # noqa: E402
from tandem.decoder.backends.cpu.isa import this_cpu  # noqa: E402


def long_prompt(rng: random.Random, num_tokens: int) -> decoder_pb2.GenerateRequest:
    """`num_tokens` random ordinary token ids, one token to generate: its time is its prefill."""
    request = _request(max_new_tokens=1)
    del request.prompt[:]
    ids = tensor_pb2.TokenIds(ids=[rng.randrange(100, 40_000) for _ in range(num_tokens)])
    request.prompt.append(decoder_pb2.PromptSegment(token_ids=ids))
    return request


def prefill_s(stub: decoder_pb2_grpc.DecoderStub, request: decoder_pb2.GenerateRequest) -> float:
    start = time.monotonic()
    for _ in stub.Generate(request, timeout=600):
        pass
    return time.monotonic() - start


class Neighbour(threading.Thread):
    """One greedy stream, each token's arrival time kept, until cancelled."""

    def __init__(self, stub: decoder_pb2_grpc.DecoderStub) -> None:
        super().__init__(daemon=True)
        self.call = stub.Generate(_request("An unrelated request", max_new_tokens=4096), timeout=900)
        self.arrivals: list[float] = []

    def run(self) -> None:
        try:
            for response in self.call:
                if response.delta.token_ids:
                    self.arrivals.append(time.monotonic())
        except grpc.RpcError:
            pass  # cancelled

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between tokens that end in [start, end], the first from the last token before start."""
        times = self.arrivals
        return [b - a for a, b in zip(times, times[1:], strict=False) if start < b <= end]


def beside(
    stub: decoder_pb2_grpc.DecoderStub, request: decoder_pb2.GenerateRequest
) -> tuple[float, list[float]]:
    """(the long prompt's time, the neighbour's gaps meanwhile) with a stream already decoding."""
    neighbour = Neighbour(stub)
    neighbour.start()
    while len(neighbour.arrivals) < 8:
        time.sleep(0.05)
    start = time.monotonic()
    seconds = prefill_s(stub, request)
    end = time.monotonic()
    time.sleep(0.5)  # the token after the prefill's last step
    neighbour.call.cancel()
    neighbour.join(timeout=60)
    return seconds, neighbour.gaps(start, end + 0.5)


def _range(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--settings",
        default="0,256,512",
        help="thresholds (0: off; off: no flag, i.e. the default 512 or a build before the flag)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=2047)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cpu = this_cpu()
    print(f"CPU: {cpu.model_name} ({cpu.isa_summary}); {platform.node()}; load {os.getloadavg()[0]:.1f}")
    settings = args.settings.split(",")
    rng = random.Random(0)
    servers = []
    try:
        for setting in settings:
            flags = () if setting == "off" else ("--long-prefill-token-threshold", setting)
            servers.append(_start("tandem.decoder", None, flags))
        channels = [grpc.insecure_channel(address) for _, address in servers]
        stubs = [decoder_pb2_grpc.DecoderStub(channel) for channel in channels]
        for stub in stubs:
            prefill_s(stub, long_prompt(rng, args.prompt_tokens))  # warm-up
        alone: dict[str, list[float]] = {s: [] for s in settings}
        together: dict[str, list[float]] = {s: [] for s in settings}
        worst: dict[str, list[float]] = {s: [] for s in settings}
        median: dict[str, list[float]] = {s: [] for s in settings}
        for _ in range(args.repeats):
            for setting, stub in zip(settings, stubs, strict=True):
                alone[setting].append(prefill_s(stub, long_prompt(rng, args.prompt_tokens)))
                seconds, gaps = beside(stub, long_prompt(rng, args.prompt_tokens))
                together[setting].append(seconds)
                worst[setting].append(max(gaps))
                median[setting].append(statistics.median(gaps))
        for channel in channels:
            channel.close()
    finally:
        for process, _ in servers:
            process.terminate()
            process.wait(timeout=60)
    print(
        f"\nA {args.prompt_tokens:,}-token prompt beside a decoding stream: median (range) of {args.repeats}"
    )
    print(f"rounds, settings in turn; load at the end {os.getloadavg()[0]:.1f}\n")
    print("| threshold | prefill alone (s) | prefill beside (s) | neighbour worst gap (s) | median gap (s) |")
    print("|---|---|---|---|---|")
    for setting in settings:
        print(
            f"| {setting} | {_range(alone[setting])} | {_range(together[setting])} "
            f"| {_range(worst[setting])} | {_range(median[setting], 3)} |"
        )


if __name__ == "__main__":
    main()
