"""`tandem`: one command for the services and their tools.

tandem serve decoder [flags]     the decoder (see --help for its flags)
tandem serve encoder [flags]     the encoder
tandem import-gguf FILE DIR      convert a GGUF file (Llama, Qwen3) into a checkpoint directory
tandem make-model DIR            write a random-weight checkpoint (tests, benchmark shapes)
tandem generate --prompt TEXT    stream a generation from a running decoder
tandem chat                      chat with a running decoder through the model's chat template to the terminal
tandem bench [flags]             run bench/harness.py (a source checkout): every workload and peer
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from google.protobuf import json_format

from common.gguf_import import DTYPE_NAMES, ImportProgress

if TYPE_CHECKING:
    from common.telemetry import Telemetry


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"] and len(argv) >= 2:
        if argv[1] == "decoder":
            from services.decoder.api.main import main as decoder_main

            return decoder_main(argv[2:])
        if argv[1] == "encoder":
            from services.encoder.__main__ import main as encoder_main

            return encoder_main(argv[2:])
    if argv[:1] == ["up"]:
        from services.up import main as up_main

        return up_main(argv[1:])
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from services.demo import main as demo_main

        return demo_main()
    if args.command == "make-model":
        from services.decoder.models.random_model import make_model

        try:
            print(make_model(args.dir, shape=args.shape, seed=args.seed))
        except ValueError as error:  # an unknown shape, named with the known ones
            parser.error(str(error))
        return 0
    if args.command == "import-gguf":
        return _import_gguf(args)
    if args.command == "generate":
        return asyncio.run(_generate(args))
    if args.command == "chat":
        from services.chat_cli import run_chat

        return asyncio.run(run_chat(args, sys.stdin, sys.stdout))
    parser.error(f"unknown command {args.command}")
    return 2


def build_parser() -> argparse.ArgumentParser:
    """The commands that are not dispatched whole to another module (`serve`, `up`, `bench` are)."""
    from common.flags import add_client_security_flags

    parser = argparse.ArgumentParser(
        prog="tandem", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run a service: tandem serve decoder|encoder [flags]")
    serve.add_argument("service", choices=["decoder", "encoder"])
    make = commands.add_parser(
        "make-model", help="write a random-weight checkpoint (for tests and benchmark shapes; noise out)"
    )
    make.add_argument("dir")
    make.add_argument(
        "--shape", default="tiny-random", help="tiny-random (default), bench-small or qwen3-0.6b"
    )
    make.add_argument("--seed", type=int, default=0)
    imp = commands.add_parser("import-gguf", help="convert a GGUF file into a checkpoint directory")
    imp.add_argument("file", type=Path, help="the .gguf file (Llama or Qwen3, any type gguf dequantizes)")
    imp.add_argument("dir", type=Path, help="the checkpoint directory to write")
    imp.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES, help="weights (default bfloat16)")
    gen = commands.add_parser("generate", help="stream a generation from a running decoder")
    gen.add_argument("--address", default="127.0.0.1:50052")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--json", action="store_true", help="print each raw event as JSON")
    add_client_security_flags(gen)
    gen.add_argument(
        "--trace",
        action="store_true",
        help="trace the call and print its trace id (hex) to stderr; spans are exported only where "
        "OTEL_* configures an exporter (e.g. OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    chat = commands.add_parser(
        "chat",
        help="chat with a running decoder: one user turn per line, /reset starts over",
        description="Multi-turn chat through the model's chat template, each reply streamed. On a "
        "terminal it prompts for each turn; from a pipe or file it reads one user turn per line.",
    )
    chat.add_argument(
        "--address", default="127.0.0.1:50052", help="decoder address (default 127.0.0.1:50052)"
    )
    chat.add_argument("--system", default=None, help="a system message opening the conversation")
    chat.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply (default 256)")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    chat.add_argument("--seed", type=int, default=None, help="sampling seed")
    add_client_security_flags(chat)
    commands.add_parser("demo", help="start both services, stream one generation, stop them")
    commands.add_parser("up", help="run both services in the foreground: tandem up --help")
    commands.add_parser("bench", help="run the benchmark harness: tandem bench --help")
    return parser


def _import_gguf(args: argparse.Namespace) -> int:
    from common.gguf_import import GGUFImportError, import_gguf

    def progress(p: ImportProgress) -> None:
        print(f"\rimporting {args.file.name}: {p.num_done}/{p.num_tensors} tensors", end="", file=sys.stderr)

    try:
        import_gguf(args.file, args.dir, args.dtype, on_progress=progress)
    except GGUFImportError as error:
        print(f"\ntandem import-gguf: {error}", file=sys.stderr)  # after the progress line
        return 2
    print(file=sys.stderr)
    print(args.dir)
    return 0


def _bench(args: list[str]) -> int:
    """Replace this process with bench/harness.py of the source checkout, given the same arguments."""
    import os

    harness = Path(__file__).resolve().parents[1] / "bench" / "harness.py"
    if not harness.is_file():
        print(f"error: {harness} not found; tandem bench runs from a source checkout", file=sys.stderr)
        return 2
    os.execv(sys.executable, [sys.executable, str(harness), *args])
    return 0  # not reached: execv does not return


async def _generate(args: argparse.Namespace) -> int:
    import os

    from opentelemetry import trace

    from common.telemetry import setup_telemetry

    # Client spans and metrics go wherever OTEL_* says; --trace also makes a trace id when it says nothing.
    telemetry = setup_telemetry("tandem-cli", os.environ, always_trace=args.trace)
    try:
        with telemetry.tracer.start_as_current_span("tandem generate", kind=trace.SpanKind.CLIENT) as span:
            if args.trace:
                trace_id = trace.format_trace_id(span.get_span_context().trace_id)
                print(f"trace id: {trace_id}", file=sys.stderr, flush=True)
            return await _stream_generation(args, telemetry)
    finally:
        telemetry.shutdown()


async def _stream_generation(args: argparse.Namespace, telemetry: Telemetry) -> int:
    import grpc

    from common.client import DecoderClient
    from common.flags import client_security
    from common.pb.tandem.v1 import decoder_pb2

    request = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.PromptSegment(text=args.prompt)])
    request.stopping.max_new_tokens = args.max_tokens
    request.stopping.stop_sequences.extend(args.stop)
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            setattr(request.sampling, name, getattr(args, name))
    try:
        security = client_security(args)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    async with DecoderClient(args.address, telemetry=telemetry, security=security) as client:
        try:
            async for response in client.generate(request):
                if args.json:
                    print(json.dumps(json_format.MessageToDict(response)), flush=True)
                elif response.HasField("delta"):
                    print(response.delta.text, end="", flush=True)
                elif response.HasField("finished"):
                    f = response.finished
                    reason = decoder_pb2.FinishReason.Name(f.reason)
                    print(
                        f"\n[{reason}; {f.usage.output_tokens} tokens; ttft {f.time_to_first_token_s:.3f}s]"
                    )
        except grpc.aio.AioRpcError as error:
            print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
