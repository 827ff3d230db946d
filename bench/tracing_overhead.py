"""Tracing overhead: decode throughput through gRPC with telemetry on vs off, in one process and one run.

One engine serves two in-process decoder servers on loopback: one without telemetry (no interceptors,
the servicer records nothing) and one with everything on: the OTel gRPC server and client
interceptors, the `text_completion` span with its timeline events, and every metric, exported to
in-process no-op exporters (spans through a `BatchSpanProcessor`, metrics through a periodic reader
that also runs the engine gauges' callbacks every second). Each run sends `--streams` concurrent
Generate streams (random token prompts, prefix caching off, EOS ignored, one message per token) and
measures output tokens / wall time. Runs alternate off/on, in alternating order, after one warm-up
each; the overhead is reported from the medians and from the median of each adjacent pair's ratio,
which drifts less on a noisy machine.

Run: `.venv/bin/python bench/tracing_overhead.py` (tiny model; `--shape bench-small` for a step that
costs what a small real model's does).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.client import telemetry as otel  # noqa: E402
from tandem.client.client import DecoderClient  # noqa: E402
from tandem.client.pb.tandem.v1 import decoder_pb2_grpc  # noqa: E402
from tandem.common.server import RunningServer, ServerOptions, Service, start_server  # noqa: E402
from tandem.common.torch_part.random_model import make_model  # noqa: E402
from tandem.decoder.api.servicer import DecoderServicer  # noqa: E402
from tandem.decoder.config import EngineConfig  # noqa: E402
from tandem.decoder.engine.front.engine import Engine  # noqa: E402
from tandem.decoder.models.loader import load_model  # noqa: E402

MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class NoOpSpanExporter(SpanExporter):
    def __init__(self) -> None:
        self.num_spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.num_spans += len(spans)
        return SpanExportResult.SUCCESS


class NoOpMetricExporter(MetricExporter):
    def __init__(self) -> None:
        super().__init__(preferred_temporality={}, preferred_aggregation={})

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs
    ) -> MetricExportResult:
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


def traced_telemetry(service: str, spans: NoOpSpanExporter) -> otel.Telemetry:
    reader = PeriodicExportingMetricReader(NoOpMetricExporter(), export_interval_millis=1000)
    return otel.build_telemetry(service, [BatchSpanProcessor(spans)], [reader])


async def serve(engine: Engine, model: str, telemetry: otel.Telemetry | None) -> RunningServer:
    interceptors = telemetry.server_interceptors() if telemetry is not None else []
    servicer = DecoderServicer(model, MAX_MESSAGE_BYTES, engine=engine, telemetry=telemetry)
    server = await start_server(
        ServerOptions(port=0, max_message_bytes=MAX_MESSAGE_BYTES, interceptors=interceptors),
        [Service("tandem.v1.Decoder", servicer, decoder_pb2_grpc.add_DecoderServicer_to_server)],
    )
    await server.set_serving()
    return server


async def run(client: DecoderClient, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """Output tokens per second for all prompts streamed at once, and process CPU microseconds per token
    (all threads: event loop, engine, exporters), which other load on the machine disturbs less."""

    async def one(prompt: list[int]) -> int:
        _, finished = await client.generate_text([prompt], max_new_tokens=new_tokens, ignore_eos=True)
        return finished.usage.output_tokens

    start, start_cpu = time.perf_counter(), time.process_time()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    num_tokens = sum(counts)
    return num_tokens / (time.perf_counter() - start), (time.process_time() - start_cpu) / num_tokens * 1e6


async def main(args: argparse.Namespace) -> None:
    model_dir = make_model(Path(tempfile.mkdtemp(prefix="tandem-bench-")), shape=args.shape)
    loaded = load_model(model_dir, "float32" if args.shape == "tiny-random" else "bfloat16", "cpu")
    blocks_per_stream = -(-(args.prompt_len + args.new_tokens) // 16)
    engine = Engine(
        EngineConfig(
            model_dir=model_dir,
            dtype="float32" if args.shape == "tiny-random" else "bfloat16",
            max_num_seqs=args.streams,
            block_size=16,
            num_kv_blocks=args.streams * blocks_per_stream + 8,
            enable_prefix_caching=False,
            num_threads=args.threads,
        ),
        loaded,
    ).start()
    spans = NoOpSpanExporter()
    server_t, client_t = traced_telemetry("tandem-decoder", spans), traced_telemetry("bench-client", spans)
    off_server = await serve(engine, args.shape, None)
    on_server = await serve(engine, args.shape, server_t)
    clients = {
        "off": DecoderClient(off_server.address, MAX_MESSAGE_BYTES),
        "on": DecoderClient(on_server.address, MAX_MESSAGE_BYTES, telemetry=client_t),
    }
    vocab = min(1000, loaded.config.vocab_size)
    generator = torch.Generator().manual_seed(0)

    def prompts() -> list[list[int]]:
        return torch.randint(0, vocab, (args.streams, args.prompt_len), generator=generator).tolist()

    results: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for mode in ("off", "on"):  # warm-up
            await run(clients[mode], prompts(), args.new_tokens)
        for i in range(args.repeats):
            for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                tokens_per_s, cpu_us_per_token = await run(clients[mode], prompts(), args.new_tokens)
                results[mode].append(tokens_per_s)
                cpu[mode].append(cpu_us_per_token)
            print(
                f"repeat {i + 1}: off {results['off'][-1]:8.1f} tok/s {cpu['off'][-1]:6.1f} cpu-us/tok   "
                f"on {results['on'][-1]:8.1f} tok/s {cpu['on'][-1]:6.1f} cpu-us/tok"
            )
    finally:
        for client in clients.values():
            await client.close()
        for server in (off_server, on_server):
            await server.stop(0)
        engine.shutdown()
        server_t.shutdown()
        client_t.shutdown()
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    paired = statistics.median(1 - b / a for a, b in zip(results["off"], results["on"], strict=True))
    print(
        f"\n{args.shape}, {args.streams} streams x {args.new_tokens} tokens (prompt {args.prompt_len}), "
        f"{args.repeats} repeats, {args.threads} torch thread(s)"
    )
    print(f"tracing off: {off:8.1f} tok/s (median)")
    print(f"tracing on:  {on:8.1f} tok/s (median); {spans.num_spans} spans exported")
    print(f"overhead: {100 * (1 - on / off):+.1f}% (medians), {100 * paired:+.1f}% (median of paired runs)")
    cpu_off, cpu_on = statistics.median(cpu["off"]), statistics.median(cpu["on"])
    cpu_overhead = 100 * (cpu_on / cpu_off - 1)
    print(f"process CPU per token: off {cpu_off:.1f} us, on {cpu_on:.1f} us: {cpu_overhead:+.1f}%")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="tiny-random", choices=["tiny-random", "bench-small"])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
