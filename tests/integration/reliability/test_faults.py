"""Faults: a server failing transiently, the encoder killed mid-load, the decoder stopped under load.

What the callers see is the promise: idempotent unary calls ride out a transient UNAVAILABLE by the
client's retry policy, and so does a Generate that no server began (one that has begun is never
replayed); a dead encoder is UNAVAILABLE to its clients and
nothing to the decoder's, and serves again once restarted on its port; a SIGTERM'd decoder ends
every open stream finished or UNAVAILABLE within its grace period. Every wait here is bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from common.tests.ports import free_port
from tandem.client.client import DecoderClient, EncoderClient
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, encoder_pb2
from tandem.common.server import RunningServer, ServerOptions, Service, start_server
from tandem.decoder.api.servicer import DecoderServicer

from .harness import MAX_MESSAGE_BYTES, Services

REPO_ROOT = Path(__file__).resolve().parents[3]
SERVING = health_pb2.HealthCheckResponse.SERVING
STARTUP_TIMEOUT_S = 60.0
DECODER_GRACE_S = 2.0
LONG_STREAM_TOKENS = 240  # the harness decoder's context is 256


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}


async def _wait_serving(client: DecoderClient | EncoderClient, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        assert process.poll() is None, f"the server exited with {process.returncode}"
        assert time.monotonic() < deadline, f"not SERVING within {STARTUP_TIMEOUT_S} s"
        try:
            if await client.health(timeout=1) == SERVING:
                return
        except grpc.aio.AioRpcError:
            pass  # not listening yet
        await asyncio.sleep(0.1)


async def _code(call: Callable[[], Awaitable[Any]]) -> grpc.StatusCode:
    try:
        await call()
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


class FailFirstAttempt(grpc.aio.ServerInterceptor):
    """Answers the first call of every method UNAVAILABLE, as a server that is restarting would."""

    def __init__(self) -> None:
        self.attempts: Counter[str] = Counter()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        self.attempts[handler_call_details.method] += 1
        if handler is None or self.attempts[handler_call_details.method] > 1:
            return handler

        async def unavailable(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")

        serializer = handler.response_serializer
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(unavailable, response_serializer=serializer)
        return grpc.unary_unary_rpc_method_handler(unavailable, response_serializer=serializer)


def test_calls_no_server_began_are_retried_through_a_transient_unavailable(
    services: Services,
) -> None:
    flaky = FailFirstAttempt()

    async def start() -> RunningServer:
        server = await start_server(
            ServerOptions(
                host="127.0.0.1", port=0, max_message_bytes=MAX_MESSAGE_BYTES, interceptors=[flaky]
            ),
            [
                Service(
                    "tandem.v1.Decoder",
                    DecoderServicer("flaky", MAX_MESSAGE_BYTES, engine=services.engine),
                    decoder_pb2_grpc.add_DecoderServicer_to_server,
                ),
                services.encoder_servicer.service(),
            ],
        )
        await server.set_serving()
        return server

    server = services.run(start())

    async def calls() -> dict[str, grpc.StatusCode]:
        async with DecoderClient(server.address) as decoder, EncoderClient(server.address) as encoder:
            return {
                "/grpc.health.v1.Health/Check": await _code(decoder.health),
                "/tandem.v1.Encoder/Embed": await _code(lambda: encoder.embed(text="hi")),
                "/tandem.v1.Encoder/Tokenize": await _code(
                    lambda: encoder.stub.Tokenize(
                        encoder_pb2.EncoderTokenizeRequest(texts=["hi"]), timeout=10
                    )
                ),
                "/tandem.v1.Encoder/GetModelInfo": await _code(
                    lambda: encoder.stub.GetModelInfo(encoder_pb2.EncoderGetModelInfoRequest(), timeout=10)
                ),
                "/tandem.v1.Decoder/Tokenize": await _code(lambda: decoder.tokenize(["hi"])),
                "/tandem.v1.Decoder/GetModelInfo": await _code(decoder.model_info),
                "/tandem.v1.Decoder/Generate": await _code(
                    lambda: decoder.generate_text(["hi"], max_new_tokens=2, timeout=10)
                ),
            }

    try:
        codes = asyncio.run(calls())
    finally:
        services.run(server.stop(0))
    assert codes == dict.fromkeys(codes, grpc.StatusCode.OK)
    assert all(flaky.attempts[method] == 2 for method in codes), flaky.attempts
    assert services.idle()


class FailAfterAccepted(decoder_pb2_grpc.DecoderServicer):
    """A Generate that begins (its first response goes out) and then fails UNAVAILABLE."""

    def __init__(self) -> None:
        self.calls = 0

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.calls += 1
        yield decoder_pb2.GenerateResponse(request_id="begun", accepted=decoder_pb2.PromptAccepted())
        await context.abort(grpc.StatusCode.UNAVAILABLE, "engine failed")


def test_a_generate_that_has_begun_is_never_replayed() -> None:
    async def run() -> tuple[grpc.StatusCode, list[str], int]:
        servicer = FailAfterAccepted()
        server = await start_server(
            ServerOptions(host="127.0.0.1", port=0),
            [Service("tandem.v1.Decoder", servicer, decoder_pb2_grpc.add_DecoderServicer_to_server)],
        )
        await server.set_serving()
        seen: list[str] = []
        try:
            async with DecoderClient(server.address) as decoder:
                try:
                    async for response in decoder.generate([[1, 2]], max_new_tokens=2, timeout=10):
                        seen.append(response.WhichOneof("event"))
                except grpc.aio.AioRpcError as error:
                    return error.code(), seen, servicer.calls
        finally:
            await server.stop(0)
        return grpc.StatusCode.OK, seen, servicer.calls

    code, seen, calls = asyncio.run(run())
    # The caller saw the stream begin, so it alone decides whether to ask again.
    assert (code, seen, calls) == (grpc.StatusCode.UNAVAILABLE, ["accepted"], 1)


def _start_encoder(model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    with log.open("a") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tandem.encoder", "--model", str(model_dir), "--port", str(port)]
            + ["--dtype", "float32", "--grace-s", "1"],
            cwd=REPO_ROOT,
            env=_clean_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


async def _encoder_kill_and_restart(
    services: Services, model_dir: Path, log: Path, processes: list[subprocess.Popen]
) -> Counter[str]:
    port = free_port()
    outcomes: Counter[str] = Counter()
    stop = asyncio.Event()
    async with (
        EncoderClient(f"127.0.0.1:{port}", MAX_MESSAGE_BYTES) as encoder,
        DecoderClient(services.decoder_server.address, MAX_MESSAGE_BYTES) as decoder,
    ):
        processes.append(_start_encoder(model_dir, port, log))
        await _wait_serving(encoder, processes[-1])

        async def pipeline(i: int) -> None:
            """Embed with the encoder, generate from the embeddings: the caller of both services."""
            while not stop.is_set():
                try:
                    embedded = await encoder.embed(text=f" worker {i} writes", timeout=10)
                except grpc.aio.AioRpcError as error:
                    outcomes[f"Embed {error.code().name}"] += 1
                    await asyncio.sleep(0.05)
                    continue
                outcomes["Embed OK"] += 1
                _, finished = await decoder.generate_text([embedded.embeddings, " and"], max_new_tokens=4)
                assert finished.usage.output_tokens >= 1
                outcomes["Generate OK"] += 1

        async def long_stream(i: int) -> int:
            """A decoder stream that is running when the encoder dies."""
            _, finished = await decoder.generate_text(
                [[3 + i, 4, 5]], max_new_tokens=LONG_STREAM_TOKENS, ignore_eos=True, timeout=120
            )
            return finished.usage.output_tokens

        async def until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
            deadline = time.monotonic() + timeout_s
            while not condition():
                assert time.monotonic() < deadline, f"no {what} within {timeout_s} s: {outcomes}"
                await asyncio.sleep(0.02)

        workers = [asyncio.create_task(pipeline(i)) for i in range(8)]
        streams = [asyncio.create_task(long_stream(i)) for i in range(4)]
        await until(lambda: outcomes["Embed OK"] >= 16, "embeddings before the kill")
        processes[-1].kill()  # SIGKILL: no drain, connections reset
        processes[-1].wait()
        outcomes["decoder streams open at the kill"] = sum(not s.done() for s in streams)
        assert outcomes["decoder streams open at the kill"] >= 1
        await until(lambda: outcomes["Embed UNAVAILABLE"] >= 8, "UNAVAILABLE from the dead encoder")
        # UNAVAILABLE, not DEADLINE_EXCEEDED at the call's 30 s deadline: the retries gave up on their
        # own, the caller is not left hanging.
        assert await _code(lambda: encoder.embed(text="anyone?", timeout=30)) == grpc.StatusCode.UNAVAILABLE
        assert await decoder.health() == SERVING
        assert await asyncio.wait_for(asyncio.gather(*streams), timeout=120) == [LONG_STREAM_TOKENS] * 4

        processes.append(_start_encoder(model_dir, port, log))  # the same port
        await _wait_serving(encoder, processes[-1])  # the same client and channel reconnect
        ok_before = outcomes["Embed OK"]
        await until(lambda: outcomes["Embed OK"] >= ok_before + 16, "embeddings after the restart")
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), timeout=60)
        outcomes["Embed OK after restart"] = outcomes["Embed OK"] - ok_before
    return outcomes


def test_killing_the_encoder_mid_load_spares_the_decoder_and_a_restart_serves_again(
    services: Services, tiny_model_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "encoder.log"
    processes: list[subprocess.Popen] = []
    try:
        outcomes = asyncio.run(_encoder_kill_and_restart(services, tiny_model_dir, log, processes))
    except BaseException:
        print(log.read_text() if log.exists() else "no encoder log")
        raise
    finally:
        for process in processes:
            _kill(process)
    print(f"encoder kill -9 outcomes: {dict(outcomes)}")
    embed_errors = {key for key in outcomes if key.startswith("Embed ") and not key.startswith("Embed OK")}
    assert embed_errors == {"Embed UNAVAILABLE"}
    assert outcomes["Embed OK after restart"] >= 16
    assert outcomes["Generate OK"] == outcomes["Embed OK"]  # every embedding got its generation
    assert services.idle()


async def _sigterm_under_load(process: subprocess.Popen, address: str) -> tuple[Counter[str], float]:
    outcomes: Counter[str] = Counter()
    async with DecoderClient(address) as client:
        await _wait_serving(client, process)

        async def one(i: int, accepted: asyncio.Event) -> None:
            request = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.PromptSegment(text=f"stream {i}")])
            request.stopping.max_new_tokens = 24 if i % 2 else 3000  # half finish within the grace period
            request.stopping.ignore_eos = True
            call = client.generate(request, timeout=120)
            finished = None
            try:
                while (response := await call.read()) is not grpc.aio.EOF:
                    accepted.set()
                    if response.HasField("finished"):
                        finished = response.finished
                assert finished is not None, "a stream ended OK without its Finished event"
                outcomes[f"OK {decoder_pb2.FinishReason.Name(finished.reason)}"] += 1
            except grpc.aio.AioRpcError as error:
                outcomes[error.code().name] += 1
            finally:
                accepted.set()

        accepted = [asyncio.Event() for _ in range(32)]
        streams = [asyncio.create_task(one(i, accepted[i])) for i in range(32)]
        await asyncio.wait_for(asyncio.gather(*(a.wait() for a in accepted)), timeout=60)
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        # None hangs: every stream has ended shortly after the grace period.
        await asyncio.wait_for(asyncio.gather(*streams), timeout=DECODER_GRACE_S + 20)
        ended_after_s = time.monotonic() - signalled
        # A draining or stopped decoder turns new calls away.
        late = await _code(lambda: client.generate_text(["too late"], max_new_tokens=2, timeout=10))
        outcomes[f"new call after SIGTERM: {late.name}"] += 1
    return outcomes, ended_after_s


def test_sigterm_to_the_decoder_under_load_ends_every_stream_with_its_finished_event(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "decoder.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tandem.decoder", "--model", str(tiny_model_dir)]
            + ["--port", str(port), "--dtype", "float32", "--num-threads", "1", "--block-size", "16"]
            + ["--grace-s", str(DECODER_GRACE_S), "--max-num-seqs", "32"],
            cwd=REPO_ROOT,
            env=_clean_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        outcomes, ended_after_s = asyncio.run(_sigterm_under_load(process, f"127.0.0.1:{port}"))
        returncode = process.wait(timeout=30)
    except BaseException:
        print(log.read_text())
        raise
    finally:
        _kill(process)
    print(f"decoder SIGTERM outcomes: {dict(outcomes)}; the last stream ended {ended_after_s:.1f} s after it")
    assert returncode == 0, log.read_text()
    streams = {k: v for k, v in outcomes.items() if not k.startswith("new call")}
    # Short ones drain; long ones are cut when the grace period runs out, with FINISH_REASON_ABORTED
    # and the tokens they had, never with an error status.
    assert set(streams) == {"OK FINISH_REASON_LENGTH", "OK FINISH_REASON_ABORTED"}, outcomes
    assert sum(streams.values()) == 32 and streams["OK FINISH_REASON_LENGTH"] >= 16
    assert outcomes["new call after SIGTERM: UNAVAILABLE"] == 1  # (none hung: each ended within its wait)
