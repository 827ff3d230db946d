"""`make demo` / `tandem demo`: both services on the default model, a real question, clean stop.

The question is asked as a chat turn twice: once as text, once with the turn's content being the
encoder's embeddings of the same words. The server renders both with the model's chat template and
both stream the same answer, which is the product in one picture: the decoder cannot tell the
embedded words from the tokenized ones.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import grpc
from opentelemetry import trace

from tandem.client.client import DecoderClient, EncoderClient
from tandem.client.pb.tandem.v1 import decoder_pb2, tensor_pb2
from tandem.client.telemetry import Telemetry, setup_telemetry
from tandem.common.torch_part.model_cache import resolve_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(name: str, args: list[str]) -> subprocess.Popen:
    """The service as a child; its log goes to a file whose tail is shown if it fails to start."""
    print(f"[demo] starting the {name}: {' '.join(args)}", flush=True)
    log_file = tempfile.NamedTemporaryFile(prefix=f"tandem-demo-{name}-", suffix=".log", delete=False)
    process = subprocess.Popen([sys.executable, "-m", f"tandem.{name}", *args], stderr=log_file)
    process.log_path = Path(log_file.name)  # type: ignore[attr-defined]
    log_file.close()
    return process


def _log_tail(process: subprocess.Popen, num_lines: int = 15) -> str:
    lines = process.log_path.read_text(errors="replace").splitlines()  # type: ignore[attr-defined]
    return "\n".join(f"    {line}" for line in lines[-num_lines:])


async def _wait_serving(client: EncoderClient | DecoderClient, name: str, process: subprocess.Popen) -> None:
    started = time.monotonic()
    while True:
        if process.poll() is not None:
            raise RuntimeError(
                f"the {name} exited with code {process.returncode} while starting; its last lines:\n"
                + _log_tail(process)
            )
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
    encoder = _start("encoder", [*common, "--port", str(encoder_port)])
    decoder = _start("decoder", [*common, "--port", str(decoder_port)])
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
            process.log_path.unlink(missing_ok=True)  # type: ignore[attr-defined]


# Asked so that the answer does not hang on a near tie: bare, "What is the capital of France?" gives
# SmolLM2 two first tokens 0.1 apart even in float32, and bf16 runs that sum in different orders
# (oneDNN, the C kernels on each ISA) then answer differently. This one gives every path "Paris".
QUESTION = "What is the capital of France? Answer in one sentence."


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
        print(f"[demo] user: {QUESTION}", flush=True)
        answer = await _stream(dec, "a chat turn as text", [QUESTION])
        embedded = await enc.embed(text=QUESTION)
        print(
            f"[demo] encoder: the question, {len(embedded.token_ids.ids)} tokens -> embeddings "
            f"{list(embedded.embeddings.shape)} {tensor_pb2.DataType.Name(embedded.embeddings.dtype)}",
            flush=True,
        )
        answer_mixed = await _stream(
            dec, "the same turn, its content the encoder's embeddings", [embedded.embeddings]
        )
        same = "the same text" if answer == answer_mixed else "DIFFERENT text"
        print(f"[demo] both prompts gave {same}", flush=True)


async def _stream(dec: DecoderClient, title: str, content: list[str | tensor_pb2.Tensor]) -> str:
    """Streams one greedy chat reply to stdout (the server applies the model's template); returns it."""
    print(f"[demo] {title}; streaming:\n", flush=True)
    finished, text = None, []
    # Greedy: the two turns must give comparable answers.
    call = dec.chat([{"role": "user", "content": content}], temperature=0.0, max_new_tokens=48, timeout=120)
    async for response in call:
        if response.HasField("delta"):
            text.append(response.delta.text)
            print(response.delta.text, end="", flush=True)
        elif response.HasField("finished"):
            finished = response.finished
    assert finished is not None
    print(f"\n\n[demo] finished: {summary(finished)}", flush=True)
    return "".join(text)


def summary(finished: decoder_pb2.Finished) -> str:
    """The finished event in words: the reason, the counts, the time to the first token and the rate
    after it, both from the server's clock. The first token carries the prompt's prefill, so over a
    short answer (8 tokens here) a rate that counts it measured mostly the prefill: 2 tokens/s."""
    reason = decoder_pb2.FinishReason.Name(finished.reason)
    num_tokens = finished.usage.output_tokens
    words = (
        f"{reason}, {finished.usage.input_tokens} prompt positions, {num_tokens} tokens, "
        f"time to first token {finished.time_to_first_token_s * 1000:.1f} ms"
    )
    decode_s = finished.total_time_s - finished.time_to_first_token_s
    if num_tokens < 2 or decode_s <= 0:
        return words
    return f"{words}, then {(num_tokens - 1) / decode_s:.1f} tokens/s"


def command() -> click.Command:
    return click.Command(
        "demo",
        callback=main,
        help="Start both services on the default model (imported on first use), ask it a question as "
        "a chat turn, as text and as the encoder's embeddings, stream both answers, stop. "
        "`make demo` runs this.",
    )


def main() -> int:
    try:
        # Imported once here (on first use), so the two services never race to convert the same file.
        model_dir = resolve_model(None, "bfloat16", say=lambda line: print(f"[demo] {line}", flush=True))
    except ValueError as error:  # ModelNotFound, GGUFImportError: one line saying what to do
        print(f"[demo] {error}", file=sys.stderr, flush=True)
        return 1
    try:
        asyncio.run(_run(model_dir))
    except (RuntimeError, TimeoutError) as error:
        print(f"[demo] {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
