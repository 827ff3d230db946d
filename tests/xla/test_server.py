"""`tandem serve decoder --device neuron --world-size N` over gRPC: XLA's CPU device stands in for N
NeuronCores, one SPMD program over them, and the streams carry the CPU engine's greedy tokens."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from common.tests.ports import free_port
from services.decoder.tests.engine.engine_helpers import run_concurrently
from tandem.client.client import DecoderClient, Segment
from tandem.common.torch_part import tensors
from tandem.common.torch_part.prompt_parts import EmbeddingPrompt, PromptPart, TextPrompt
from tandem.decoder.engine.admission.chat import ChatMessage, ChatRequest
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Delta
from tandem.decoder.engine.params import SamplingParams, StoppingParams
from tests.xla.helpers import engine_on, prompts_of_each_kind

NUM_TOKENS = 32
DEMO_QUESTION = "What is the capital of France? Answer in one sentence."
# Every prompt of a kind at once in one decode graph of 16 rows; prompts up to 32 positions in one
# prefill graph, a chat turn of 42 in two chunks; 80 positions of context: one block-table width.
LIMITS = dict(max_num_seqs=16, max_num_batched_tokens=32, max_model_len=80, block_size=16)
BUCKETS = dict(seq_buckets=(16,), token_buckets=(32,), block_table_buckets=(5,))


def _flags(values: dict[str, object]) -> list[str]:
    return [
        arg
        for name, value in values.items()
        for arg in (
            f"--{name.replace('_', '-')}",
            ",".join(map(str, value)) if isinstance(value, tuple) else str(value),
        )
    ]


@contextmanager
def serve_decoder(model_dir: Path, world_size: int) -> Iterator[tuple[str, subprocess.Popen]]:
    """The venv's own `tandem serve decoder` on a free loopback port; stopped with SIGTERM (its log is
    read after)."""
    port = free_port()
    argv = [str(Path(sys.executable).parent / "tandem"), "serve", "decoder", "--model", str(model_dir)]
    argv += ["--device", "neuron", "--world-size", str(world_size), "--dtype", "float32"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--grace-s", "5", *_flags({**LIMITS, **BUCKETS})]
    env = {k: v for k, v in os.environ.items() if k != "CPU_NUM_DEVICES"}  # the server sets its own
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield f"127.0.0.1:{port}", process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def _wait_serving(client: DecoderClient, process: subprocess.Popen) -> list[int]:
    """Health answers until SERVING; returns every status seen (NOT_SERVING while loading and warming)."""
    seen: list[int] = []
    for _ in range(2400):
        assert process.poll() is None, process.stdout.read() if process.stdout else ""
        try:
            status = await client.health(timeout=1)
            seen.append(status)
            if status == health_pb2.HealthCheckResponse.SERVING:
                return seen
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.25)
    raise AssertionError("the decoder never became SERVING")


def _segment(part: PromptPart) -> Segment:
    if isinstance(part, EmbeddingPrompt):
        return tensors.encode(part.rows, torch.float32)
    return list(part)  # type: ignore[arg-type]


async def _greedy_over_grpc(client: DecoderClient, prompts: list[list[PromptPart]]) -> list[list[int]]:
    async def one(prompt: list[PromptPart]) -> list[int]:
        call = client.generate(
            [_segment(p) for p in prompt], max_new_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True
        )
        return [t async for r in call if r.HasField("delta") for t in r.delta.token_ids]

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def _cpu_tokens(model_dir: Path, prompts: list[list[PromptPart]], **settings: object) -> list[list[int]]:
    """The CPU engine's greedy tokens for `prompts`, all at once, with `settings` (quantization="int8")."""
    with engine_on(
        "cpu", model_dir=model_dir, dtype="float32", num_kv_blocks=96, **LIMITS, **settings
    ) as cpu:
        return greedy_at_once(cpu, prompts)


def greedy_at_once(engine: Engine, prompts: list[list[PromptPart]]) -> list[list[int]]:
    """`engine`'s NUM_TOKENS greedy tokens for each of `prompts`, every prompt submitted at once (one
    decode batch, as a server's concurrent streams)."""
    specs = [
        GenerateSpec(p, SamplingParams(temperature=0.0), StoppingParams(NUM_TOKENS, ignore_eos=True))
        for p in prompts
    ]
    events = run_concurrently(engine, specs)
    return [[t for e in es if isinstance(e, Delta) for t in e.token_ids] for es in events]


def _demo_answer_on_cpu(model_dir: Path) -> list[int]:
    chat = ChatRequest([ChatMessage("user", [TextPrompt(DEMO_QUESTION)])])
    spec = GenerateSpec([], SamplingParams(temperature=0.0), StoppingParams(NUM_TOKENS), chat=chat)
    with engine_on("cpu", model_dir=model_dir, dtype="float32", num_kv_blocks=96, **LIMITS) as cpu:
        return [t for e in cpu.generate(spec) if isinstance(e, Delta) for t in e.token_ids]


@pytest.fixture(scope="module")
def cpu_reference() -> Callable[[Path, int], tuple[dict[str, list[list[PromptPart]]], list[list[int]]]]:
    """A model's prompts of each kind and the CPU engine's greedy tokens for them, computed once for
    every device count (the prompts are a function of the model alone)."""
    computed: dict[Path, tuple[dict[str, list[list[PromptPart]]], list[list[int]]]] = {}

    def reference(model_dir: Path, vocab_size: int) -> tuple[dict, list[list[int]]]:
        if model_dir not in computed:
            kinds = prompts_of_each_kind(model_dir, vocab_size, count=5)
            computed[model_dir] = kinds, _cpu_tokens(model_dir, [p for kind in kinds.values() for p in kind])
        return computed[model_dir]

    return reference


# Each case takes a layout path the others do not (backends/xla/sharding.py):
# - tiny-1: one device, no SPMD program at all.
# - tiny-2: 4 query / 2 KV heads divide over 2 devices: head-parallel attention, the KV cache split.
# - tiny-4: 2 KV heads do not divide over 4: each device holds the KV cache whole and attention is not
#   head-split; sequence-parallel prefill over 4 windows.
# - smollm2-2: a real checkpoint's own tokens (Llama, 9 query / 3 KV heads, a tied 49152-token
#   table) over 2 devices, its 3 KV heads not dividing either: sequence-parallel prefill of a trained
#   model, and the demo's chat answer ("Paris").
# SmolLM2 on 1 device (its logits at every prefill position: test_step.py; its bf16 answers:
# test_fidelity.py) and on 4 (tiny-4's path, each rank's window 8 positions instead of 16) add no path
# these do not take, at 40 s and 105 s of the suite's time on 2 cores.
CASES = [("tiny", 1), ("tiny", 2), ("tiny", 4), ("smollm2", 2)]


@pytest.mark.parametrize(("model", "world_size"), CASES, ids=[f"{m}-{n}" for m, n in CASES])
async def test_token_embedding_and_mixed_prompts_stream_the_cpu_engines_tokens_on_n_devices(
    model: str, world_size: int, tiny_model_dir: Path, smollm2_dir: Path, cpu_reference
) -> None:
    model_dir = tiny_model_dir if model == "tiny" else smollm2_dir
    vocab_size = 1024 if model == "tiny" else 49152
    kinds, want = cpu_reference(model_dir, vocab_size)
    prompts = [p for kind in kinds.values() for p in kind]  # 15: 5 of each kind, 3 to 19 positions
    demo = _demo_answer_on_cpu(model_dir) if model == "smollm2" else None
    with serve_decoder(model_dir, world_size) as (address, process):
        async with DecoderClient(address) as client:
            seen = await _wait_serving(client, process)
            got = await _greedy_over_grpc(client, prompts)
            if demo is not None:
                call = client.chat(
                    [{"role": "user", "content": DEMO_QUESTION}], max_new_tokens=NUM_TOKENS, temperature=0.0
                )
                deltas = [r.delta async for r in call if r.HasField("delta")]
    log = process.stdout.read() if process.stdout else ""
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen  # while the weights load and graphs compile
    assert "XLA buckets: decode rows [16], prefill positions [32]" in log
    assert "XLA: 0 graphs compiled after warmup" in log, log[-2000:]
    for kind, start in zip(kinds, range(0, 15, 5), strict=True):
        assert got[start : start + 5] == want[start : start + 5], kind
    if demo is not None:  # the demo's question, from several XLA devices
        assert [t for d in deltas for t in d.token_ids] == demo
        assert "Paris" in "".join(d.text for d in deltas)


async def test_tandem_up_with_the_decoder_on_neuron_streams_the_cpu_engines_tokens(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Both services from the venv's own `tandem up`; the decoder's buckets from its TANDEM_* variables.
    encoder_port, decoder_port = free_port(), free_port()
    argv = [str(Path(sys.executable).parent / "tandem"), "up", "--model", str(tiny_model_dir)]
    argv += ["--device", "neuron", "--world-size", "2", "--dtype", "float32", "--grace-s", "5"]
    argv += ["--encoder-port", str(encoder_port), "--decoder-port", str(decoder_port)]
    env = {k: v for k, v in os.environ.items() if k != "CPU_NUM_DEVICES"}
    env.update(
        {
            f"TANDEM_{name.upper()}": ",".join(map(str, v)) if isinstance(v, tuple) else str(v)
            for name, v in {**LIMITS, **BUCKETS}.items()
        }
    )
    prompt = [[[5, 9, 300, 41, 7]]]  # one prompt of one token-ID part
    want = _cpu_tokens(tiny_model_dir, prompt)
    log = tmp_path / "up.log"
    with log.open("w") as out:
        up = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        async with DecoderClient(f"127.0.0.1:{decoder_port}") as client:
            await _wait_serving(client, up)
            assert await _greedy_over_grpc(client, prompt) == want
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
    text = log.read_text()
    assert "XLA buckets: decode rows [16]" in text and "XLA: 0 graphs compiled after warmup" in text, text[
        -3000:
    ]
