"""`make demo` / `tandem demo`: both services on loopback, one streamed generation, clean stop.

The prompt mixes text tokens with embeddings the encoder produced, which is the product in one
picture: the decoder cannot tell the embedded words from the tokenized ones.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from opentelemetry import trace

from common.client import DecoderClient, EncoderClient
from common.pb.tandem.v1 import decoder_pb2, tensor_pb2
from common.telemetry import Telemetry, setup_telemetry
from services.decoder.models.default_model import default_model_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(name: str, args: list[str]) -> subprocess.Popen:
    print(f"[demo] starting the {name}: {' '.join(args)}", flush=True)
    return subprocess.Popen([sys.executable, "-m", f"services.{name}", *args], stderr=subprocess.DEVNULL)


async def _wait_serving(client: EncoderClient | DecoderClient, name: str, process: subprocess.Popen) -> None:
    started = time.monotonic()
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the {name} exited with code {process.returncode} while starting")
        try:
            if await client.health(timeout=1) == 1:  # SERVING
                print(f"[demo] {name} SERVING after {time.monotonic() - started:.1f} s", flush=True)
                return
        except grpc.aio.AioRpcError:
            pass
        if time.monotonic() - started > 300:
            raise TimeoutError(f"the {name} did not become SERVING within 300 s")
        await asyncio.sleep(0.2)


async def _run(model_dir: Path) -> None:
    encoder_port, decoder_port = _free_port(), _free_port()
    common = ["--model", str(model_dir), "--host", "127.0.0.1"]
    encoder = _start("encoder", [*common, "--port", str(encoder_port), "--dtype", "float32"])
    decoder = _start("decoder", [*common, "--port", str(decoder_port), "--dtype", "float32"])
    # A trace id even when no OTEL_* is set (nothing is exported then); with an OTLP endpoint set for
    # the demo and both services, the Embed and the Generate below land in this one trace.
    telemetry = setup_telemetry("tandem-demo", os.environ, always_trace=True)
    try:
        with telemetry.tracer.start_as_current_span("tandem demo", kind=trace.SpanKind.CLIENT) as span:
            addresses = (f"127.0.0.1:{encoder_port}", f"127.0.0.1:{decoder_port}")
            await _embed_and_generate(*addresses, encoder, decoder, telemetry)
        print(f"[demo] trace id {trace.format_trace_id(span.get_span_context().trace_id)}", flush=True)
    finally:
        telemetry.shutdown()
        for process in (decoder, encoder):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for name, process in (("decoder", decoder), ("encoder", encoder)):
            code = process.wait(timeout=60)
            print(f"[demo] {name} stopped (exit {code})", flush=True)


async def _embed_and_generate(
    encoder_address: str,
    decoder_address: str,
    encoder: subprocess.Popen,
    decoder: subprocess.Popen,
    telemetry: Telemetry,
) -> None:
    async with (
        EncoderClient(encoder_address, telemetry=telemetry) as enc,
        DecoderClient(decoder_address, telemetry=telemetry) as dec,
    ):
        await _wait_serving(enc, "encoder", encoder)
        await _wait_serving(dec, "decoder", decoder)
        embedded = await enc.embed(text=" the quiet harbour", output_dtype=tensor_pb2.DATA_TYPE_FLOAT32)
        print(
            f"[demo] encoder: {len(embedded.token_ids.ids)} tokens -> embeddings "
            f"{list(embedded.embeddings.shape)} {tensor_pb2.DataType.Name(embedded.embeddings.dtype)}",
            flush=True,
        )
        request = decoder_pb2.GenerateRequest(
            prompt=[
                decoder_pb2.PromptSegment(text="Once upon a time, in"),
                decoder_pb2.PromptSegment(embeddings=embedded.embeddings),
                decoder_pb2.PromptSegment(text=","),
            ]
        )
        request.stopping.max_new_tokens = 48
        request.sampling.temperature = 0.7
        request.sampling.seed = 7
        print("[demo] prompt: text + encoder embeddings + text; streaming:\n", flush=True)
        started = time.monotonic()
        finished = None
        async for response in dec.generate(request, timeout=120):
            if response.HasField("delta"):
                print(response.delta.text, end="", flush=True)
            elif response.HasField("finished"):
                finished = response.finished
        elapsed = time.monotonic() - started
        assert finished is not None
        reason = decoder_pb2.FinishReason.Name(finished.reason)
        print(
            f"\n\n[demo] finished: {reason}, {finished.usage.input_tokens} prompt positions, "
            f"{finished.usage.output_tokens} tokens"
        )
        print(
            f"[demo] time to first token {finished.time_to_first_token_s * 1000:.1f} ms, "
            f"{finished.usage.output_tokens / elapsed:.1f} tokens/s"
        )


def main() -> int:
    model_dir = default_model_dir()
    if not (model_dir / "config.json").exists():
        from services.decoder.models.default_model import make_model

        print(f"[demo] creating the embedded default model in {model_dir}", flush=True)
        make_model(model_dir)
    asyncio.run(_run(model_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
