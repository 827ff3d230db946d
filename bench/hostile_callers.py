"""The hostile-caller attacks of issues 18 and 49 against both services and the OpenAI gateway as
processes: what the attacker gets, what a neighbour sees meanwhile, and what the server keeps. The
figures of docs/RELIABILITY.md.

Both services start as `python -m tandem.decoder` / `python -m tandem.encoder` with their
documented defaults (the default model unless `--model`), on free loopback ports, and the gateway
(`python -m tandem.gateway`) in front of them. This process is only a client: health probes (1 s
deadline, every 100 ms: gRPC health for the services, GET /health for the gateway), the neighbour's
streams and the attacks run here, so the servers' event loops and GILs are their own. Server memory
is read from /proc/<pid>/status: VmRSS (now) and VmHWM (peak); the gateway's includes its body
workers. HTTP callers are told apart by their source address (127.0.0.2, 127.0.0.9: every 127/8
address is loopback on Linux), as the gateway tells them apart without tokens.

Run: `.venv/bin/python bench/hostile_callers.py [--model DIR] [--rounds 200] [--only gateway]`. It
prints one markdown table; nothing is asserted (the reliability tests hold the promises).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.client.channel import channel_options  # noqa: E402
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, encoder_pb2, tensor_pb2  # noqa: E402
from tandem.decoder.backends.cpu.isa import this_cpu  # noqa: E402

MIB = 1024 * 1024
OPTIONS = channel_options(64 * MIB)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(module: str, model: Path | None, flags: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`python -m module` on a free loopback port with `flags`, once its health says SERVING."""
    port = _free_port()
    argv = [sys.executable, "-m", module, "--port", str(port)] + (["--model", str(model)] if model else [])
    argv += flags
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(1200):
            if process.poll() is not None:
                raise SystemExit(f"{module} exited with {process.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return process, address
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    raise SystemExit(f"{module} never became SERVING")


def _memory_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MB, of `pid` and its children (the gateway's body workers)."""
    rss = hwm = 0.0
    for one in [pid, *_children(pid)]:
        try:
            text = Path(f"/proc/{one}/status").read_text()
        except FileNotFoundError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines())
        rss += int(fields["VmRSS"].split()[0]) / 1024
        hwm += int(fields["VmHWM"].split()[0]) / 1024
    return rss, hwm


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return found


def _start_gateway(decoder: str, encoder: str) -> tuple[subprocess.Popen, str]:
    """`python -m tandem.gateway` in front of both, with its defaults, once /health answers 200."""
    port = _free_port()
    argv = [sys.executable, "-m", "tandem.gateway", "--port", str(port)]
    argv += ["--decoder-address", decoder, "--encoder-address", encoder]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        if process.poll() is not None:
            raise SystemExit(f"the gateway exited with {process.returncode}")
        try:
            if _http("GET", port, "/health", timeout=1.0)[0] == 200:
                return process, f"127.0.0.1:{port}"
        except OSError:
            pass
        time.sleep(0.25)
    raise SystemExit("the gateway never answered /health")


def _http(
    method: str,
    port: int,
    path: str,
    body: bytes | None = None,
    source: str = "127.0.0.1",
    timeout: float = 300.0,
) -> tuple[int, bytes]:
    """One HTTP request from `source`; (status, body)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _request(prompt: str = "Once upon a time", max_new_tokens: int = 32, request_id: str = ""):
    request = decoder_pb2.GenerateRequest(
        request_id=request_id, prompt=[decoder_pb2.PromptSegment(text=prompt)]
    )
    request.sampling.temperature = 0.0
    request.stopping.max_new_tokens = max_new_tokens
    request.stopping.ignore_eos = True
    return request


class Probe(threading.Thread):
    """Health every 100 ms with a 1 s deadline; longest time without an answer. `http`: the
    gateway's GET /health (any answer counts: 503 while the decoder is down is still an answer)."""

    def __init__(self, address: str, http: bool = False) -> None:
        super().__init__(daemon=True)
        self.address, self.stop, self.unanswered, self.longest_silence = address, threading.Event(), 0, 0.0
        self.http = http

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub, last = health_pb2_grpc.HealthStub(channel), time.monotonic()
            port = int(self.address.rpartition(":")[2])
            while not self.stop.is_set():
                try:
                    if self.http:
                        _http("GET", port, "/health", timeout=1.0)
                    else:
                        stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    last = time.monotonic()
                except (grpc.RpcError, OSError):
                    self.unanswered += 1
                self.longest_silence = max(self.longest_silence, time.monotonic() - last)
                time.sleep(0.1)


class Neighbour(threading.Thread):
    """Back-to-back greedy streams; the largest gap between two of their messages. `http`: streamed
    completions through the gateway, from another caller's address (127.0.0.5), gaps between events."""

    def __init__(self, address: str, http: bool = False) -> None:
        super().__init__(daemon=True)
        self.address, self.stop, self.gaps, self.http = address, threading.Event(), [0.0], http

    def run(self) -> None:
        if self.http:
            return self._run_http(int(self.address.rpartition(":")[2]))
        with grpc.insecure_channel(self.address) as channel:
            stub = decoder_pb2_grpc.DecoderStub(channel)
            while not self.stop.is_set():
                last = time.monotonic()
                for _ in stub.Generate(_request(max_new_tokens=16), timeout=300):
                    self.gaps.append(time.monotonic() - last)
                    last = time.monotonic()

    def _run_http(self, port: int) -> None:
        body = {"model": "", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "stream": True,
                "ignore_eos": True}  # fmt: skip
        while not self.stop.is_set():
            connection = http.client.HTTPConnection(
                "127.0.0.1", port, timeout=300, source_address=("127.0.0.5", 0)
            )
            connection.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            last, response = time.monotonic(), connection.getresponse()
            while line := response.readline():
                if line.startswith(b"data: "):
                    self.gaps.append(time.monotonic() - last)
                    last = time.monotonic()
            connection.close()


def attack_under_watch(
    name: str,
    attack: Callable[[], str],
    server: subprocess.Popen,
    address: str,
    neighbour_address: str | None,
    http: bool = False,
) -> list[str]:
    """Run `attack` (returns the status it got) while health is probed and a neighbour streams."""
    probe = Probe(address, http)
    neighbour = Neighbour(neighbour_address, http) if neighbour_address else None
    rss_before, _ = _memory_mb(server.pid)
    probe.start()
    if neighbour:
        neighbour.start()
    time.sleep(1.0)
    start = time.monotonic()
    status = attack()
    took = time.monotonic() - start
    time.sleep(1.0)
    probe.stop.set()
    if neighbour:
        neighbour.stop.set()
        neighbour.join(300)
    probe.join(30)
    rss_after, peak = _memory_mb(server.pid)
    gap = f"{max(neighbour.gaps):.2f} s" if neighbour else "-"
    return [
        name,
        f"{status} in {took:.2f} s",
        f"{probe.longest_silence:.2f} s, {probe.unanswered} unanswered",
        gap,
        f"{rss_before:.0f} -> {rss_after:.0f} MB (peak so far {peak:.0f})",
    ]


def _status(call: Callable[[], object]) -> str:
    try:
        result = call()
        if hasattr(result, "__next__"):  # a stream: read it to its status
            list(result)  # type: ignore[call-overload]
        return "OK"
    except grpc.RpcError as error:
        return error.code().name


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="default: the services' default model")
    parser.add_argument("--rounds", type=int, default=200, help="cancel-then-reuse rounds")
    parser.add_argument(
        "--only",
        choices=("services", "gateway", "held-open"),
        default=None,
        help="the services' attacks, the gateway's, or only the gateway's held-open streams",
    )
    args = parser.parse_args()
    cpu = this_cpu()
    print(f"CPU: {cpu.model_name} [{cpu.isa_summary}], {os.cpu_count()} cores", flush=True)
    decoder_process, decoder_address = _start("tandem.decoder", args.model)
    encoder_process, encoder_address = _start("tandem.encoder", args.model)
    gateway_process, gateway_address = _start_gateway(decoder_address, encoder_address)
    rows: list[list[str]] = []
    try:
        if args.only != "services":
            stub = decoder_pb2_grpc.DecoderStub(grpc.insecure_channel(decoder_address, options=OPTIONS))
            attacks = _gateway_attacks(int(gateway_address.rpartition(":")[2]), stub)
            for name, attack, neighbour in attacks[-1:] if args.only == "held-open" else attacks:
                rows.append(
                    attack_under_watch(
                        name, attack, gateway_process, gateway_address, neighbour and gateway_address, True
                    )
                )
                print(" | ".join(rows[-1]), flush=True)
        if args.only in ("gateway", "held-open"):
            return _print(rows)
        decoder_channel = grpc.insecure_channel(decoder_address, options=OPTIONS)
        encoder_channel = grpc.insecure_channel(encoder_address, options=OPTIONS)
        raw_generate = decoder_channel.unary_stream("/tandem.v1.Decoder/Generate")
        raw_decoder_tokenize = decoder_channel.unary_unary("/tandem.v1.Decoder/Tokenize")
        raw_embed = encoder_channel.unary_unary("/tandem.v1.Encoder/Embed")
        decoder = decoder_pb2_grpc.DecoderStub(decoder_channel)
        info = decoder.GetModelInfo(decoder_pb2.DecoderGetModelInfoRequest(), timeout=30)
        text = "All work and no play makes Jack a dull boy. " * (30 * MIB // 44)
        big_text = decoder_pb2.GenerateRequest(
            prompt=[decoder_pb2.PromptSegment(text=text)]
        ).SerializeToString()
        big_tokenize = decoder_pb2.DecoderTokenizeRequest(texts=[text]).SerializeToString()
        big_embed = encoder_pb2.EmbedRequest(text=text).SerializeToString()
        num_rows = 60 * MIB // (4 * info.hidden_size)
        rows_message = decoder_pb2.GenerateRequest(
            prompt=[
                decoder_pb2.PromptSegment(
                    embeddings=tensor_pb2.Tensor(
                        dtype=tensor_pb2.DATA_TYPE_FLOAT32,
                        shape=[num_rows, info.hidden_size],
                        data=bytes(num_rows * info.hidden_size * 4),
                    )
                )
            ]
        ).SerializeToString()
        del text
        _status(lambda: decoder.Generate(_request(), timeout=300))  # warm
        d, e = (decoder_process, decoder_address), (encoder_process, encoder_address)
        long_name = decoder_pb2.GenerateRequest(
            model="m" * 20_000, prompt=[decoder_pb2.PromptSegment(text="hi")]
        )
        attacks: list[tuple[str, Callable[[], str], tuple[subprocess.Popen, str], str | None]] = [
            ("no attack (control)", lambda: _neighbour_latency(decoder), d, d[1]),
            (
                "decoder Generate, 30 MB text",
                lambda: _status(lambda: raw_generate(big_text, timeout=120)),
                d,
                d[1],
            ),
            (
                "decoder Tokenize, 30 MB text",
                lambda: _status(lambda: raw_decoder_tokenize(big_tokenize, timeout=120)),
                d,
                d[1],
            ),
            (
                f"decoder Generate, 60 MB float32 rows [{num_rows}, {info.hidden_size}], 5 times",
                lambda: ", ".join(_status(lambda: raw_generate(rows_message, timeout=120)) for _ in range(5)),
                d,
                d[1],
            ),
            (
                "encoder Embed, 30 MB text",
                lambda: _status(lambda: raw_embed(big_embed, timeout=120)),
                e,
                None,
            ),
            (
                "decoder Generate, float32 3.4e38 in a row (inf in bf16), then a greedy request",
                lambda: _poison(decoder, info.hidden_size),
                d,
                None,  # alone: in a batch, bf16 logits can differ anyway (docs/ARCHITECTURE.md)
            ),
            (
                f"{args.rounds} rounds of cancel then reuse the ID",
                lambda: _cancel_then_reuse(decoder, args.rounds),
                d,
                d[1],
            ),
            (
                "streams named req-0..req-9 held open, then 5 anonymous requests",
                lambda: _squat(decoder_address, decoder),
                d,
                d[1],
            ),
            (
                "200 Generate streams on one connection, never read (default gRPC client)",
                lambda: _unread(decoder_address, decoder, 200, 1, small_window=False),
                d,
                None,
            ),
            (
                "200 Generate streams on 7 connections, never read (4 KiB windows, no BDP, top-20 logprobs)",
                lambda: _unread(decoder_address, decoder, 200, 7, small_window=True),
                d,
                None,
            ),
            (
                "640 Generate streams on 20 connections, never read (default gRPC client; issue 32)",
                lambda: _unread(decoder_address, decoder, 640, 20, small_window=False),
                d,
                None,
            ),
            (
                "1,000 Generate calls that half-close without a request",
                lambda: _half_close(decoder_address),
                d,
                d[1],
            ),
            (
                "Generate with a 20 KB model name",
                lambda: _status(lambda: decoder.Generate(long_name, timeout=30)),
                d,
                None,
            ),
        ]
        for name, attack, (process, address), neighbour in attacks:
            rows.append(attack_under_watch(name, attack, process, address, neighbour))
            print(" | ".join(rows[-1]), flush=True)
    finally:
        for process in (gateway_process, decoder_process, encoder_process):
            process.terminate()
            process.wait(60)
    _print(rows)


def _print(rows: list[list[str]]) -> None:
    print("| attack | attacker gets | health: longest silence | neighbour stream: largest gap | server RSS |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _gateway_attacks(
    port: int, decoder: decoder_pb2_grpc.DecoderStub
) -> list[tuple[str, Callable[[], str], bool]]:
    """Issue 49's attacks on the gateway: (name, attack, whether an HTTP neighbour streams meanwhile)."""
    message = b'{"role":"user","content":"hi"}'
    chat_messages = b'{"model":"","messages":[' + message + (b"," + message) * (3_000_000 - 1) + b"]}"
    bias = ('"' + '":1.0,"'.join(map(str, range(7_000_000))) + '":1.0').encode()
    logit_bias = b'{"model":"","messages":[{"role":"user","content":"hi"}],"logit_bias":{' + bias + b"}}"
    token_ids = b'{"model":"","prompt":[' + b"1," * (40_000_000 - 1) + b"1]}"
    ids = b"[" + b",".join([b"7"] * 8000) + b"]"
    embeddings = b'{"model":"","encoding_format":"base64","tandem_pooling":"none","input":['
    embeddings += b",".join([ids] * 32) + b"]}"

    def refused(path: str, body: bytes, times: int = 1) -> Callable[[], str]:
        def attack() -> str:
            statuses = []
            for _ in range(times):
                status, answer = _http("POST", port, path, body)
                statuses.append(f"{status} {json.loads(answer)['error']['param']}")
            return ", ".join(statuses)

        return attack

    chat, text = "/v1/chat/completions", "/v1/completions"
    mb = lambda body: f"{len(body) / 1e6:.1f} MB"  # noqa: E731
    return [
        ("gateway: no attack (control), 5 s", lambda: time.sleep(5.0) or "-", True),
        (f"gateway chat, 3M messages ({mb(chat_messages)})", refused(chat, chat_messages), True),
        (f"gateway chat, 7M logit_bias entries ({mb(logit_bias)})", refused(chat, logit_bias), True),
        (f"gateway completions, 40M token IDs ({mb(token_ids)})", refused(text, token_ids), True),
        (
            f"gateway embeddings, 32 inputs of 8,000 IDs, rows asked ({mb(embeddings)}), 3 times",
            refused("/v1/embeddings", embeddings, 3),
            True,
        ),
        (
            "gateway: 600 sockets trickling a request head, a byte a second",
            lambda: _trickling(port, 600),
            True,
        ),
        (
            "gateway: 32 completions held open (never read) by 127.0.0.2, then 127.0.0.9's 32 tokens",
            lambda: _held_open(port, decoder),
            False,
        ),
    ]


def _trickling(port: int, num_sockets: int) -> str:
    """Slow clients: sockets that send a request head a byte a second (the gateway closes one without
    a whole head after --header-timeout-s, and answers those beyond --max-connections 503 at once)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sockets, refused, closed_after = [], 0, []
    start = time.monotonic()
    for _ in range(num_sockets):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.setblocking(False)
        sockets.append(sock)
    open_ = set(range(num_sockets))
    for i in range(len(head)):
        if not open_ or time.monotonic() - start > 60:
            break
        for k in list(open_):
            try:
                answer = sockets[k].recv(4096)
            except BlockingIOError:
                answer = None
            except OSError:
                answer = b""
            if answer is not None:  # an answer (a 503) or the end: this socket is done
                refused += answer.startswith(b"HTTP/1.1 503")
                closed_after.append(time.monotonic() - start)
                open_.discard(k)
                continue
            try:
                sockets[k].send(head[i : i + 1])
            except OSError:
                closed_after.append(time.monotonic() - start)
                open_.discard(k)
        time.sleep(1.0)
    for sock in sockets:
        sock.close()
    timed_out = len(closed_after) - refused
    latest = max(closed_after) if closed_after else 0.0
    return (
        f"{refused} answered 503 at once, {timed_out} closed by the gateway (the last {latest:.0f} s in), "
        f"{len(open_)} still open"
    )


def _http_neighbour(port: int, source: str) -> float:
    """An HTTP caller's 32 greedy tokens, not streamed: seconds."""
    body = {
        "model": "",
        "prompt": "An unrelated request",
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
    }
    start = time.monotonic()
    status, answer = _http("POST", port, "/v1/completions", json.dumps(body).encode(), source)
    if status != 200:
        raise SystemExit(f"the neighbour got {status}: {answer[:300]!r}")
    return time.monotonic() - start


def _held_open(port: int, decoder: decoder_pb2_grpc.DecoderStub, rounds: int = 3) -> str:
    """Issue 49, item 3: one HTTP caller holds 32 streams open and reads nothing; another caller's 32
    tokens beside them, 20 s in, against the same caller's alone just before, round after round (each
    ratio pairs two measurements a minute apart, so a machine whose load drifts is seen drifting); and
    a gRPC neighbour's beside the same streams (the decoder's own sharing, without the gateway)."""
    body = json.dumps(
        {"model": "", "prompt": "Once upon a time", "max_tokens": 1024, "temperature": 0, "ignore_eos": True,
         "stream": True}
    ).encode()  # fmt: skip
    ratios, described, refused = [], [], 0
    for _ in range(rounds):
        alone = _http_neighbour(port, "127.0.0.9")
        held = []
        for _ in range(32):
            connection = http.client.HTTPConnection(
                "127.0.0.1", port, timeout=600, source_address=("127.0.0.2", 0)
            )
            connection.request(
                "POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"}
            )
            refused += connection.getresponse().status != 200  # the headers; the events are never read
            held.append(connection)
        time.sleep(20.0)  # the streams get going and fill what buffers they can
        beside = _http_neighbour(port, "127.0.0.9")
        direct = _grpc_neighbour(decoder)
        for connection in held:
            connection.close()
        ratios.append(beside / alone)
        described.append(f"{beside:.2f}/{alone:.2f} s (gRPC {direct:.2f} s)")
    return (
        f"{32 * rounds - refused} of {32 * rounds} streams opened; the other caller's 32 tokens beside them "
        f"/ alone: {', '.join(described)}: median {statistics.median(ratios):.1f}x"
    )


def _grpc_neighbour(decoder: decoder_pb2_grpc.DecoderStub) -> float:
    start = time.monotonic()
    list(decoder.Generate(_request("An unrelated request", max_new_tokens=32), timeout=300))
    return time.monotonic() - start


def _poison(decoder: decoder_pb2_grpc.DecoderStub, hidden: int) -> str:
    baseline = [
        t for r in decoder.Generate(_request(max_new_tokens=40), timeout=300) for t in r.delta.token_ids
    ]
    rows = np.zeros((4, hidden), dtype="<f4")
    rows[2, 5] = np.finfo(np.float32).max
    poison = decoder_pb2.GenerateRequest(
        prompt=[
            decoder_pb2.PromptSegment(
                embeddings=tensor_pb2.Tensor(
                    dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=[4, hidden], data=rows.tobytes()
                )
            )
        ]
    )
    status = _status(lambda: decoder.Generate(poison, timeout=60))
    after = [t for r in decoder.Generate(_request(max_new_tokens=40), timeout=300) for t in r.delta.token_ids]
    return (
        f"{status}; the next greedy request {'equals' if after == baseline else 'DIFFERS FROM'} its baseline"
    )


def _neighbour_latency(decoder: decoder_pb2_grpc.DecoderStub) -> str:
    start = time.monotonic()
    status = _status(
        lambda: decoder.Generate(_request("An unrelated request", max_new_tokens=32), timeout=300)
    )
    return f"a neighbour's 32 tokens: {status} in {time.monotonic() - start:.1f} s"


def _cancel_then_reuse(decoder: decoder_pb2_grpc.DecoderStub, rounds: int) -> str:
    """Each round: a stream is accepted, cancelled, and its ID reused at once. A hang is a reused
    stream accepted and then silent until its deadline (120 s, far beyond any step)."""
    outcomes: dict[str, int] = {}
    slowest = 0.0
    for _ in range(rounds):
        first = decoder.Generate(_request(max_new_tokens=200, request_id="reused"), timeout=120)
        next(first)
        first.cancel()
        start = time.monotonic()
        outcome = _status(
            partial(decoder.Generate, _request(max_new_tokens=2, request_id="reused"), timeout=120)
        )
        slowest = max(slowest, time.monotonic() - start)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) + f"; slowest reuse {slowest:.1f} s"


def _squat(address: str, decoder: decoder_pb2_grpc.DecoderStub) -> str:
    with grpc.insecure_channel(address) as channel:
        squatter = decoder_pb2_grpc.DecoderStub(channel)
        held = [
            squatter.Generate(_request(max_new_tokens=200, request_id=f"req-{i}"), timeout=300)
            for i in range(10)
        ]
        for call in held:
            next(call)
        outcomes = [
            _status(lambda: decoder.Generate(_request(max_new_tokens=4), timeout=60)) for _ in range(5)
        ]
        for call in held:
            call.cancel()
    return f"anonymous: {', '.join(outcomes)}"


def _unread(
    address: str,
    decoder: decoder_pb2_grpc.DecoderStub,
    num_streams: int,
    num_connections: int,
    small_window: bool,
) -> str:
    # A local subchannel pool: otherwise channels to one target share one connection.
    options = [("grpc.use_local_subchannel_pool", 1)]
    if small_window:
        options += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 4096)]
    channels = [grpc.insecure_channel(address, options=options) for _ in range(num_connections)]
    request = _request(max_new_tokens=1024)
    request.output.logprobs = small_window
    request.output.top_logprobs = 20 if small_window else 0
    calls = [
        decoder_pb2_grpc.DecoderStub(channels[i % len(channels)]).Generate(request, timeout=600)
        for i in range(num_streams)
    ]
    time.sleep(30.0)  # the streams get going (and, with small windows, fill them and pause)
    start = time.monotonic()
    neighbour = _status(
        lambda: decoder.Generate(_request("An unrelated request", max_new_tokens=32), timeout=300)
    )
    waited = time.monotonic() - start
    refused = 0
    for call in calls:
        try:
            next(call)
        except grpc.RpcError as error:
            refused += error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        call.cancel()
    for channel in channels:
        channel.close()
    return (
        f"{num_streams - refused} streams open, {refused} RESOURCE_EXHAUSTED; "
        f"a neighbour's 32 tokens: {neighbour} in {waited:.1f} s"
    )


def _half_close(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        method = channel.stream_stream("/tandem.v1.Decoder/Generate")
        calls = [method(iter(()), timeout=60) for _ in range(1000)]
        time.sleep(5.0)
        still_open = sum(not call.done() for call in calls)
        codes = {}
        for call in calls:
            call.cancel()
            code = call.code().name
            codes[code] = codes.get(code, 0) + 1
    return f"{still_open} still open after 5 s; " + ", ".join(f"{k} {v}" for k, v in sorted(codes.items()))


if __name__ == "__main__":
    main()
