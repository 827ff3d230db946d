"""Hostile and careless callers against live servers: one caller's mistakes and attacks stay its own.

Each test replays an attack from issue 18 through raw gRPC and checks what the attacker gets, what a
neighbour sees meanwhile, and that nothing is left behind. Run with `-s` for the figures that
docs/RELIABILITY.md quotes (latencies, gaps, counts).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from tandem.client.channel import channel_options
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, encoder_pb2, tensor_pb2
from tandem.decoder.engine.outputs.backpressure import MAX_UNREAD_TOKENS
from tandem.decoder.models.loader import LoadedModel, load_model

from .cases import HIDDEN, embed_ids_wire, embeds
from .harness import Limits, Services

MIB = 1024 * 1024


def _request(
    prompt: str = "the river runs", max_new_tokens: int = 8, request_id: str = "", **output: object
) -> decoder_pb2.GenerateRequest:
    request = decoder_pb2.GenerateRequest(
        request_id=request_id, prompt=[decoder_pb2.PromptSegment(text=prompt)]
    )
    request.sampling.temperature = 0.0
    request.stopping.max_new_tokens = max_new_tokens
    request.stopping.ignore_eos = True
    for name, value in output.items():
        setattr(request.output, name, value)
    return request


def _tokens(responses: list[decoder_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]


def _timed_tokens(
    stub: decoder_pb2_grpc.DecoderStub, request: decoder_pb2.GenerateRequest
) -> tuple[list[int], float]:
    """A stream's tokens and the seconds it took, read to its end."""
    start = time.monotonic()
    tokens = _tokens(list(stub.Generate(request, timeout=120)))
    return tokens, time.monotonic() - start


def _own_connection(address: str) -> grpc.Channel:
    """A channel on a connection of its own: grpc otherwise shares one between channels to a target."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def _violation(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)
    assert status is not None, error.details()
    violation = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(violation)
    return violation.field_violations[0].field


@pytest.fixture
def serve(tiny_model_dir: Path, tiny_fp32: LoadedModel) -> Iterator:
    started: list[Services] = []

    def start(limits: Limits | None = None, loaded: LoadedModel | None = None) -> Services:
        started.append(Services(tiny_model_dir, loaded or tiny_fp32, limits))
        return started[-1]

    yield start
    for services in started:
        services.close()


# -- 1. finite on the wire, infinite in the model -----------------------------------------------


@pytest.mark.parametrize(("dtype", "overflowing"), [("bfloat16", 3.4028234e38), ("float16", 70_000.0)])
def test_rows_that_overflow_the_model_dtype_are_refused_and_poison_no_later_request(
    serve, tiny_model_dir: Path, dtype: str, overflowing: float
) -> None:
    # Accepted, such rows came back as tokens [0, 0, 0, 0] with NaN logprobs, and their NaN keys
    # and values, left in freed KV blocks, turned a later greedy request into 39 NaN logprobs of 40.
    services = serve(loaded=load_model(tiny_model_dir, dtype=dtype))
    unrelated = _request("once upon a time", max_new_tokens=40, logprobs=True)
    baseline = list(services.decoder.Generate(unrelated, timeout=60))
    rows = np.zeros((4, HIDDEN), dtype="<f4")
    rows[2, 5] = overflowing  # finite in float32, infinite once cast
    poison = decoder_pb2.GenerateRequest(prompt=[embeds([4, HIDDEN], data=rows.tobytes())])
    poison.stopping.max_new_tokens = 4
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as caught:
            list(services.decoder.Generate(poison, timeout=60))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _violation(caught.value) == "prompt[0].embeddings.data"
        assert f"as {dtype}" in caught.value.details() and "[2, 5]" in caught.value.details()
    after = list(services.decoder.Generate(unrelated, timeout=60))
    assert _tokens(after) == _tokens(baseline)
    logprobs = [lp for r in after if r.HasField("delta") for lp in r.delta.logprobs]
    assert logprobs == [lp for r in baseline if r.HasField("delta") for lp in r.delta.logprobs]
    assert all(math.isfinite(lp) for lp in logprobs)
    assert services.idle()


# -- 2. one big text must not stall the service -------------------------------------------------


class _HealthProbe(threading.Thread):
    """Asks both services' health every 100 ms with a 1 s deadline, as an orchestrator would."""

    def __init__(self, addresses: list[str]) -> None:
        super().__init__(daemon=True)
        self.channels = [grpc.insecure_channel(a) for a in addresses]
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.failures: list[str] = []

    def run(self) -> None:
        stubs = [health_pb2_grpc.HealthStub(c) for c in self.channels]
        while not self.stop.is_set():
            for stub in stubs:
                start = time.monotonic()
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    self.latencies.append(time.monotonic() - start)
                except grpc.RpcError as error:
                    self.failures.append(error.code().name)
            time.sleep(0.1)
        for channel in self.channels:
            channel.close()


def _refusals_and_health(took: dict[str, float], probe: _HealthProbe) -> str:
    """The figures docs/RELIABILITY.md quotes; asserts every attack was refused within 5 s and every
    health probe answered."""
    assert not probe.failures
    assert all(seconds < 5 for seconds in took.values()), took
    return (
        "\nrefusals: "
        + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in took.items())
        + f"\nhealth: {len(probe.latencies)} answered, slowest {max(probe.latencies):.3f} s, "
        f"{len(probe.failures)} unanswered"
    )


class _Neighbour(threading.Thread):
    """Streams greedy generations back to back and records the largest gap between two messages."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.channel = grpc.insecure_channel(address)
        self.stop = threading.Event()
        self.gaps: list[float] = []
        self.num_tokens = 0

    def run(self) -> None:
        stub = decoder_pb2_grpc.DecoderStub(self.channel)
        while not self.stop.is_set():
            last = time.monotonic()
            for response in stub.Generate(_request(max_new_tokens=60), timeout=120):
                now = time.monotonic()
                self.gaps.append(now - last)
                last = now
                self.num_tokens += len(response.delta.token_ids)
        self.channel.close()


def test_a_30_mb_text_is_refused_from_its_length_while_health_answers_and_a_neighbour_streams(serve) -> None:
    # Before: 30 MB of text kept the decoder's health unanswered for 24 s (the encoder's for 27 s),
    # a concurrent stream silent for 52 s, and 60 MB of float32 rows cost 1.0-1.6 s per refusal.
    services = serve(Limits(max_message_bytes=64 * MIB))
    text = "All work and no play makes Jack a dull boy. " * (30 * MIB // 44)
    rows = 60 * MIB // (4 * HIDDEN)
    # Serialized up front: this process is also the client, and building 30 MB messages here would
    # hold the GIL that the servers' threads need.
    attacks = {
        "decoder Generate, 30 MB text": (
            "/tandem.v1.Decoder/Generate",
            decoder_pb2.GenerateRequest(prompt=[decoder_pb2.PromptSegment(text=text)]),
            "prompt",
        ),
        "decoder Tokenize, 30 MB text": (
            "/tandem.v1.Decoder/Tokenize",
            decoder_pb2.DecoderTokenizeRequest(texts=[text]),
            "texts",
        ),
        "decoder Generate, 60 MB of float32 rows": (
            "/tandem.v1.Decoder/Generate",
            decoder_pb2.GenerateRequest(prompt=[embeds([rows, HIDDEN])]),
            "prompt",
        ),
        "encoder Embed, 30 MB text": (
            "/tandem.v1.Encoder/Embed",
            encoder_pb2.EmbedRequest(text=text),
            "text",
        ),
        "encoder Embed, 60 million token IDs": (
            "/tandem.v1.Encoder/Embed",
            embed_ids_wire(60_000_000),
            "token_ids",
        ),
        "encoder Tokenize, 30 MB text": (
            "/tandem.v1.Encoder/Tokenize",
            encoder_pb2.EncoderTokenizeRequest(texts=[text]),
            "texts",
        ),
    }
    payloads = {
        name: (path, message if isinstance(message, bytes) else message.SerializeToString(), field)
        for name, (path, message, field) in attacks.items()
    }
    del text, attacks
    options = channel_options(64 * MIB)
    channels = {
        "/tandem.v1.Decoder": grpc.insecure_channel(services.decoder_server.address, options=options),
        "/tandem.v1.Encoder": grpc.insecure_channel(services.encoder_server.address, options=options),
    }
    probe = _HealthProbe([services.decoder_server.address, services.encoder_server.address])
    neighbour = _Neighbour(services.decoder_server.address)
    probe.start()
    neighbour.start()
    time.sleep(1.0)  # the neighbour is streaming
    took = {}
    try:
        for name, (path, payload, field) in payloads.items():
            channel = channels[path.rsplit("/", 1)[0]]
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                if path.endswith("Generate"):
                    list(channel.unary_stream(path)(payload, timeout=60))
                else:
                    channel.unary_unary(path)(payload, timeout=60)
            took[name] = time.monotonic() - start
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, caught.value.details())
            assert _violation(caught.value) == field, name
        time.sleep(0.5)
    finally:
        probe.stop.set()
        neighbour.stop.set()
        probe.join(30)
        neighbour.join(120)
        for channel in channels.values():
            channel.close()
    print(
        _refusals_and_health(took, probe)
        + f"; neighbour: {neighbour.num_tokens} tokens, largest gap {max(neighbour.gaps):.3f} s"
    )
    assert max(neighbour.gaps) < 2.0
    assert services.idle()


# -- chat templates: bounded in a worker process, off everyone else's path (issue 32 items 1-2) ----


# 10^10 empty iterations: nothing printed, so only a time bound ends it.
LOOP = "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}"


def _chat_request(template: str | None = None) -> decoder_pb2.GenerateRequest:
    chat = decoder_pb2.ChatPrompt(
        messages=[decoder_pb2.ChatMessage(role="user", content=[decoder_pb2.ChatContentPart(text="hi")])]
    )
    if template is not None:
        chat.chat_template = template
    request = decoder_pb2.GenerateRequest(chat=chat)
    request.stopping.max_new_tokens = 2
    return request


def test_a_hostile_chat_template_fails_alone_while_health_answers_and_a_neighbour_chats(serve) -> None:
    # Before: 'a' * 10**9 took the server from 1.6 to 5.4 GB and silenced health 9.4 s; center(10**9)
    # 16.5 s of silence; a looping template delayed every other caller's `accepted` by 7.6-57.7 s.
    services = serve()
    attacks = {
        "'a' * 10**9": "{% set x = 'a' * 10**9 %}{{ x | length }}",
        "'a' | center(10**9)": "{{ 'a' | center(10**9) | length }}",
        "10^10 empty iterations": LOOP,
    }
    address = services.decoder_server.address
    probe = _HealthProbe([address])
    waits: list[float] = []  # a neighbour's chats: seconds to `accepted`
    failures: list[str] = []  # and any that did not complete (a thread's assert would go unseen)
    stop = threading.Event()

    def neighbour() -> None:
        with grpc.insecure_channel(address) as channel:
            stub = decoder_pb2_grpc.DecoderStub(channel)
            while not stop.is_set():
                start = time.monotonic()
                try:
                    responses = stub.Generate(_chat_request(), timeout=60)
                    accepted = next(responses).HasField("accepted")
                    waits.append(time.monotonic() - start)
                    list(responses)
                except grpc.RpcError as error:
                    failures.append(f"{error.code()}: {error.details()}")
                    continue
                if not accepted:
                    failures.append("the first response was not `accepted`")

    chats = threading.Thread(target=neighbour, daemon=True)
    probe.start()
    chats.start()
    took = {}
    try:
        with grpc.insecure_channel(address) as channel:
            stub = decoder_pb2_grpc.DecoderStub(channel)
            for name, template in attacks.items():
                start = time.monotonic()
                with pytest.raises(grpc.RpcError) as caught:
                    list(stub.Generate(_chat_request(template), timeout=60))
                took[name] = time.monotonic() - start
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, caught.value.details())
                assert _violation(caught.value) == "chat.chat_template", name
    finally:
        stop.set()
        probe.stop.set()
        chats.join(60)
        probe.join(30)
    print(
        _refusals_and_health(took, probe)
        + f"; neighbour chats: {len(waits)}, slowest accepted {max(waits):.3f} s"
    )
    assert not failures, failures  # a neighbour's chat never pays for the hostile template's worker
    assert waits and max(waits) < 2.0, waits  # no longer queued behind the hostile render
    assert services.idle()


# -- 3. request-ID reuse right after a cancel ---------------------------------------------------


def test_200_rounds_of_cancel_then_reuse_end_without_a_hang(serve) -> None:
    # Before: the cancelled stream's abort, applied by ID at the next step, removed the new stream
    # (accepted, then nothing: 17 of 200 rounds), or the reuse was refused as "already in use"
    # (152 of 200).
    services = serve()
    expected = _tokens(list(services.decoder.Generate(_request(max_new_tokens=2), timeout=30)))
    start = time.monotonic()
    for _ in range(200):
        first = services.decoder.Generate(_request(max_new_tokens=200, request_id="reused"), timeout=30)
        assert next(first).HasField("accepted")
        first.cancel()
        second = list(services.decoder.Generate(_request(max_new_tokens=2, request_id="reused"), timeout=15))
        assert second[-1].HasField("finished") and _tokens(second) == expected
        assert {r.request_id for r in second} == {"reused"}
    print(f"\n200 rounds of cancel-then-reuse in {time.monotonic() - start:.1f} s")
    assert services.idle()


# -- 4. one caller's IDs cannot reach another's requests ----------------------------------------


def test_a_caller_can_neither_collide_with_nor_probe_other_callers_requests(serve) -> None:
    # Before: server-assigned IDs were req-N in the callers' namespace; streams named req-602 to
    # req-606 made the next five anonymous requests fail "already in use", an oracle of who is in
    # flight besides.
    services = serve()
    anonymous = _request(max_new_tokens=6)
    expected = _tokens(list(services.decoder.Generate(anonymous, timeout=30)))
    squatter = grpc.insecure_channel(services.decoder_server.address)
    squatting = decoder_pb2_grpc.DecoderStub(squatter)
    held = [
        squatting.Generate(_request(max_new_tokens=200, request_id=f"req-{i}"), timeout=60) for i in range(8)
    ]
    try:
        assert all(next(call).HasField("accepted") for call in held)
        ids = []
        for _ in range(5):
            responses = list(services.decoder.Generate(anonymous, timeout=30))
            assert _tokens(responses) == expected
            ids.append(responses[0].request_id)
        assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == 5
        # The squatter takes the very ID an anonymous stream got, while that stream runs.
        victim = services.decoder.Generate(anonymous, timeout=30)
        victim_id = next(victim).request_id
        copy = list(squatting.Generate(_request(max_new_tokens=3, request_id=victim_id), timeout=30))
        assert copy[-1].HasField("finished") and {r.request_id for r in copy} == {victim_id}
        assert _tokens(list(victim)) == expected
    finally:
        for call in held:
            call.cancel()
        squatter.close()
    assert services.idle()


# -- 6. streams nobody reads --------------------------------------------------------------------


def test_a_neighbour_is_served_at_once_beside_160_unread_streams_over_5_connections(serve) -> None:
    # Before: admission was FCFS, so a neighbour waited behind every flood request queued before it
    # (640 unread streams over 20 connections on SmolLM2: 723 s for 32 tokens, 0.27 s alone). Callers
    # (here: connections) now share the batch: the neighbour's caller runs none, so it is admitted
    # first and a full batch yields it a slot. The flood's 900-token streams fit in their HTTP/2
    # windows, so none of them ever pauses: this is fairness, not backpressure.
    services = serve(
        Limits(
            max_num_seqs=16,
            max_queue=1024,
            num_kv_blocks=8192,
            max_model_len=1024,
            max_streams_per_connection=32,
            shared_step_seqs=4,
        )
    )
    neighbour = _request("an unrelated request", max_new_tokens=32)
    _timed_tokens(services.decoder, neighbour)  # warm
    expected, alone_s = _timed_tokens(services.decoder, neighbour)
    flood = _request(max_new_tokens=900)
    channels = [_own_connection(services.decoder_server.address) for _ in range(5)]
    calls = [
        decoder_pb2_grpc.DecoderStub(c).Generate(flood, timeout=600) for c in channels for _ in range(32)
    ]
    engine = services.engine
    try:
        deadline = time.monotonic() + 120
        while engine.core.num_live() < 160:
            assert time.monotonic() < deadline, f"{engine.core.num_live()} of 160 flood requests built"
            time.sleep(0.05)
        # Built is not yet admitted: the engine thread admits the last newcomers' requests a narrow
        # step at a time (a slow CI machine read 4 running here), so wait for the full batch.
        scheduler = engine.core.scheduler
        while not (scheduler.num_running == 16 and scheduler.num_waiting == 144):
            assert time.monotonic() < deadline, (scheduler.num_running, scheduler.num_waiting)
            time.sleep(0.05)
        flood_callers = {r.caller for r in scheduler.running} | {r.caller for r in scheduler.waiting}
        steps: list[list[str]] = []  # each step's requests, by caller
        schedule = scheduler.schedule

        def recording_schedule(*args, **kwargs):
            plan = schedule(*args, **kwargs)
            steps.append([item.request.caller for item in plan.scheduled])
            return plan

        scheduler.schedule = recording_schedule
        try:
            tokens, neighbour_s = _timed_tokens(services.decoder, neighbour)
        finally:
            del scheduler.schedule
        assert tokens == expected
        # Served while every flood request was still unfinished: it waited for no flood request's end.
        assert engine.core.num_live() == 160
        # Its steps were narrow (shared_step_seqs 4): its request and 3 of the flood's 16 running, in
        # turns, after the step that admitted it (a yielded slot, its prefill beside the 15 others).
        with_neighbour = [s for s in steps if any(c not in flood_callers for c in s)]
        assert len(with_neighbour) >= 32 and all(len(s) <= 4 for s in with_neighbour[1:]), with_neighbour[:3]
        print(
            f"\na neighbour's 32 tokens beside 160 unread streams (16 running, 144 waiting): "
            f"{neighbour_s:.2f} s (alone {alone_s:.2f} s, {neighbour_s / alone_s:.1f}x)"
        )
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()
    assert services.idle(timeout=60)


def test_a_connections_unread_prompt_logprobs_are_bounded_and_another_connection_is_not_refused(
    serve,
) -> None:
    # Before: each unread stream scoring a 4,000-position prompt held ~8 MB in gRPC's buffers, with
    # no bound (128 streams: +994 MB). Now a caller's open streams hold at most 4 full-context
    # prompts at 20 alternatives: here 4 x 1,024 x 21 entries, four 1,000-position prompts.
    services = serve(Limits(max_num_seqs=16, max_queue=256, num_kv_blocks=8192, max_model_len=1024))
    scoring = decoder_pb2.GenerateRequest(
        prompt=[
            decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=[3 + i % 50 for i in range(1000)]))
        ]
    )
    scoring.stopping.max_new_tokens = 8
    scoring.output.prompt_logprobs = 20
    flood = _own_connection(services.decoder_server.address)
    calls = [decoder_pb2_grpc.DecoderStub(flood).Generate(scoring, timeout=120) for _ in range(6)]
    try:
        outcomes = []
        for call in calls:
            try:
                outcomes.append("accepted" if next(call).HasField("accepted") else "?")
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
                assert "output.prompt_logprobs" in error.details() and "limit is 86016" in error.details()
                outcomes.append("refused")
        assert outcomes.count("accepted") == 4 and outcomes.count("refused") == 2
        # Another connection is another caller: its budget is whole.
        other = list(services.decoder.Generate(scoring, timeout=120))
        assert len(other[1].delta.prompt_logprobs) == 1000
        calls[0].cancel()  # an ended stream gives its share back
        deadline = time.monotonic() + 30
        while True:
            try:
                again = decoder_pb2_grpc.DecoderStub(flood).Generate(scoring, timeout=120)
                assert next(again).HasField("accepted")
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.05)
        calls.append(again)
    finally:
        for call in calls:
            call.cancel()
        flood.close()
    assert services.idle(timeout=60)


def test_one_bearer_token_holds_its_bound_over_all_its_connections_and_another_token_is_not_refused(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    # With tokens on, a token is one caller: opening more connections buys no more streams.
    services = Services(
        tiny_model_dir,
        tiny_fp32,
        Limits(max_streams_per_connection=32, max_streams_per_token=4),
        auth_tokens=frozenset({"token-a", "token-b"}),
    )
    channels = [_own_connection(services.decoder_server.address) for _ in range(3)]
    held = []
    try:

        def generate(channel: grpc.Channel, token: str):
            call = decoder_pb2_grpc.DecoderStub(channel).Generate(
                _request(max_new_tokens=200), timeout=60, metadata=[("authorization", f"Bearer {token}")]
            )
            held.append(call)
            return next(call)

        for i in range(4):  # over three connections
            assert generate(channels[i % 3], "token-a").HasField("accepted")
        with pytest.raises(grpc.RpcError) as caught:
            generate(channels[2], "token-a")
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "this bearer token already has 4 Generate streams open" in caught.value.details()
        assert generate(channels[0], "token-b").HasField("accepted")  # another caller
    finally:
        for call in held:
            call.cancel()
        for channel in channels:
            channel.close()
        assert services.idle(timeout=30)
        services.close()


def test_unread_streams_pause_and_one_connection_holds_at_most_its_bound(serve) -> None:
    # Before: 200 streams opened and never read were generated at full speed; an unrelated 32-token
    # request waited 87.7 s. A client that never reads fills its HTTP/2 window (here without BDP
    # probing and with small windows, so it fills within seconds); its streams then pause.
    services = serve(
        Limits(
            max_num_seqs=64,
            max_queue=256,
            num_kv_blocks=8192,
            max_model_len=1024,
            max_streams_per_connection=32,
        )
    )
    neighbour = _request("an unrelated request", max_new_tokens=32)
    expected, alone_s = _timed_tokens(services.decoder, neighbour)
    unread = _request(max_new_tokens=600, logprobs=True, top_logprobs=20)
    unread_expected = _tokens(list(services.decoder.Generate(unread, timeout=300)))
    attacker = grpc.insecure_channel(
        services.decoder_server.address,
        options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 4096)],
    )
    calls = [decoder_pb2_grpc.DecoderStub(attacker).Generate(unread, timeout=600) for _ in range(40)]
    scheduler, blocks = services.engine.core.scheduler, services.engine.core.block_manager
    try:
        deadline = time.monotonic() + 120
        while scheduler.num_paused < 32:
            assert time.monotonic() < deadline, f"{scheduler.num_paused} of 32 paused"
            time.sleep(0.05)
        generated = sorted(r.num_output_tokens for r in scheduler.paused.values())
        assert scheduler.num_running == scheduler.num_waiting == 0
        assert blocks.num_free_blocks == blocks.num_total_blocks  # paused streams hold no KV
        tokens, neighbour_s = _timed_tokens(services.decoder, neighbour)
        assert tokens == expected
        assert sorted(r.num_output_tokens for r in scheduler.paused.values()) == generated
        accepted, refused = [], 0
        for call in calls:
            try:
                assert next(call).HasField("accepted")
                accepted.append(call)
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
                refused += 1
        assert (len(accepted), refused) == (32, 8)
        start = time.monotonic()
        assert _tokens(list(accepted[0])) == unread_expected  # reading resumes it, tokens unchanged
        print(
            f"\n32 unread streams paused after {generated[0]}-{generated[-1]} tokens "
            f"(a 4 KiB window, then {MAX_UNREAD_TOKENS} tokens); 8 more refused RESOURCE_EXHAUSTED; "
            f"a neighbour's 32 tokens took {neighbour_s:.2f} s (alone: {alone_s:.2f} s); one unread "
            f"stream read to its end in {time.monotonic() - start:.2f} s"
        )
    finally:
        for call in calls:
            call.cancel()
        attacker.close()
    assert services.idle(timeout=30)
