"""`tandem up`'s children: each service started in a session of its own, its output relayed line by
line with a prefix, the one "ready" line, and the stop (SIGTERM to each, a kill after the margin)."""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import io
import locale
import os
import selectors
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from typing import IO, TextIO

from tandem.up_commands import ready_targets, serve_command, service_argv, service_environment
from tandem.up_config import UpConfig, services

_output_lock = threading.Lock()

# Once a service has exited, how long its relays still wait for the end of its output. What the service
# started holds its stdout and stderr too: a decoder's ranks and multiprocessing's resource tracker log
# there for it (why a rank stops, what leaked) and close them as they end, within this after it; one that
# outlives the service (ranks still loading when it was killed) must not hold the stop.
AFTER_EXIT_S = 0.5


def label(service: str) -> str:
    """A child as `up`'s own lines name it ("the openai stopped" read as a typo)."""
    return "OpenAI gateway" if service == "openai" else service


def say(message: str) -> None:
    _write(sys.stdout, f"[up] {message}\n")


def _write(stream: TextIO, text: str) -> None:
    """Writes `text`, or nothing once the reader is gone: `up 2>&1 | head -3` closed the pipe, and the
    BrokenPipeError of the next line raised out of the stop (both services were killed, no drain, exit
    1) and ended the relays, so a child logging more than a pipe holds would block. An output error
    never changes the stop: the stream's descriptor is pointed at /dev/null, the relays keep draining
    the children into it, and Python's flush at exit finds nothing to complain of."""
    with _output_lock:
        try:
            stream.write(text)
            stream.flush()
        except OSError:  # EPIPE, or EIO from a terminal that went away: the same, nobody reads
            _discard(stream)


def _discard(stream: TextIO) -> None:
    """Sends what is still buffered and all later writes of `stream` to /dev/null (Python's own advice
    for EPIPE, docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    with contextlib.suppress(OSError, ValueError):  # ValueError: no descriptor (a test's capture)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def _stop_with_parent() -> None:
    """In the child, before exec: SIGTERM when `up` dies, even by SIGKILL, so no service is orphaned."""
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class _Relay:
    """One output pipe of a service relayed line by line with its prefix, on a thread of its own, until
    every process holding the pipe has closed it or, once told the service has exited (`finish`), until
    that deadline, and then what the pipe holds at it.

    NOTE: why not until the pipe's end alone. Each process the service starts inherits the pipe, and
    a grandchild that outlived the service kept the relay reading and the stop waiting: 2 s per pipe
    before `up` went on without it, ~9 s for two services. Once the service has exited, all it wrote is
    in the pipe, ahead of anything written after, so the pipe's content at the deadline holds the last
    of the service's own lines."""

    def __init__(self, prefix: str, source: IO[bytes], sink: TextIO) -> None:
        self._prefix = prefix
        self._source = source
        self._sink = sink
        self._stop_by: float | None = None  # time.monotonic() deadline, set once by `finish`
        self._wake_read, self._wake_write = os.pipe()  # `finish` ends the thread's wait for output
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def finish(self, stop_by: float) -> None:
        self._stop_by = stop_by
        os.write(self._wake_write, b"\0")

    def join(self) -> None:
        self._thread.join()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _run(self) -> None:
        fd = self._source.fileno()
        # As the text mode of subprocess read it: the locale's encoding, any newline ending a line.
        decoder = io.IncrementalNewlineDecoder(
            codecs.getincrementaldecoder(locale.getpreferredencoding(False))(errors="replace"), translate=True
        )
        partial = ""  # the text of a line not ended yet
        is_last = False
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            selector.register(self._wake_read, selectors.EVENT_READ)
            while not is_last:
                wait_s = None if self._stop_by is None else self._stop_by - time.monotonic()
                if wait_s is not None and wait_s <= 0:
                    data, is_last = _read_buffered(fd), True
                else:
                    ready = {key.fd for key, _ in selector.select(wait_s)}
                    if self._wake_read in ready:  # `finish`: from now on, wait until its deadline only
                        selector.unregister(self._wake_read)
                    if fd not in ready:
                        continue
                    data = os.read(fd, 65536)
                    is_last = not data  # every process holding the pipe has closed it
                *lines, partial = (partial + decoder.decode(data, final=is_last)).split("\n")
                if is_last and partial:
                    lines.append(partial)
                self._relay(lines)
        self._source.close()

    def _relay(self, lines: list[str]) -> None:
        if lines:
            _write(self._sink, "".join(f"{self._prefix}{line}\n" for line in lines))


def _read_buffered(fd: int) -> bytes:
    """What the pipe `fd` holds now (FIONREAD), read without waiting for more: a grandchild writing on
    cannot keep it reading."""
    size = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    chunks = []
    while size > 0 and (chunk := os.read(fd, size)):
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


class _Child:
    """One service process and the two relays of its output."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=_stop_with_parent,
            start_new_session=True,  # a terminal's Ctrl-C reaches `up` only; `up` sends each one SIGTERM
        )
        self._relays = [
            _Relay(f"[{name}] ", self.process.stdout, sys.stdout),
            _Relay(f"[{name}] ", self.process.stderr, sys.stderr),
        ]

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def finish_relay(self) -> None:
        """Once the service has exited: the rest of its output relayed, and what its own children write
        for AFTER_EXIT_S more, or until they end. Returns at once; `join_relay` waits for it."""
        stop_by = time.monotonic() + AFTER_EXIT_S
        for relay in self._relays:
            relay.finish(stop_by)

    def join_relay(self) -> None:
        for relay in self._relays:
            relay.join()


def run_services(config: UpConfig) -> int:
    """Start both services, wait for a signal or for one to exit, stop both. Returns the exit code."""
    stop_signal: list[signal.Signals] = []
    wake = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop_signal.append(signal.Signals(signum))
        wake.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    children: list[_Child] = []
    stopping = threading.Event()
    try:
        for name in services(config):
            argv = service_argv(name, config)
            say(f"starting the {label(name)}: tandem {' '.join(serve_command(name, config))}")
            children.append(_Child(name, argv, service_environment()))
        threading.Thread(
            target=_announce_ready, args=(config, stopping), name="up-ready", daemon=True
        ).start()
        died = None
        while not stop_signal:
            died = next((c for c in children if c.process.poll() is not None), None)
            if died is not None:
                break
            wake.wait(0.2)
        if died is not None and not stop_signal:
            code = died.process.returncode
            say(f"the {label(died.name)} exited on its own (code {code}): stopping the rest")
        else:
            which = "both" if len(children) == 2 else f"all {len(children)}"
            say(f"received {stop_signal[0].name}: stopping {which} (streams get {config.grace_s:g} s)")
        stopping.set()
        return _stop_all(children, config.kill_after_s, failed=died is not None and not stop_signal)
    finally:
        stopping.set()
        for child in children:
            if child.process.poll() is None:
                child.process.kill()
                child.process.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _announce_ready(config: UpConfig, stopping: threading.Event) -> None:
    """Says once, when every service serves, that they do, where, and how to stop them. With TLS the
    probe would need the client's side of it, which `up` does not hold: it says how to wait instead."""
    from tandem.readiness import Probe, is_http

    targets = ready_targets(config)
    if config.tls_cert is not None:
        say(f"with TLS, readiness is not probed here: `tandem wait --tls-ca CA {' '.join(targets.values())}`")
        return
    # The gateway's /health answers 503 until the decoder serves: it is asked once both serve, not
    # every 0.2 s of a start to be told so.
    grpc_targets = [target for target in targets.values() if not is_http(target)]
    http_targets = [target for target in targets.values() if is_http(target)]
    for stage in (grpc_targets, http_targets):
        probe = Probe(stage)
        try:
            if probe.wait(None, stopping):
                return  # stopping before every one served
        finally:
            probe.close()
    where = ", ".join(f"{name} on {target.replace('/health', '/v1')}" for name, target in targets.items())
    say(f"ready: {where}. Ctrl-C stops them (in the background: kill {os.getpid()})")


def _stop_all(children: list[_Child], kill_after_s: float, failed: bool) -> int:
    for child in children:
        child.terminate()
    deadline = time.monotonic() + kill_after_s
    is_clean = not failed
    codes = []
    for child in children:
        try:
            code = child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            say(f"the {label(child.name)} did not stop within {kill_after_s:g} s: killing it")
            child.process.kill()
            code = child.process.wait()
            is_clean = False
        child.finish_relay()  # its AFTER_EXIT_S counts from its own exit, beside the others'
        codes.append(code)
    # Each service's lines before its "stopped": one relay's wait at a time took AFTER_EXIT_S a
    # service whose children held its pipes, one after another (1.1 s for two, where 0.5 s will do).
    for child, code in zip(children, codes, strict=True):
        child.join_relay()
        say(f"the {label(child.name)} stopped (exit {code})")
    return 0 if is_clean else 1
