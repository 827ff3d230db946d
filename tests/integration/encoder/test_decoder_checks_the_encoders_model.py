"""A decoder started with --encoder checks that the encoder serves its own model, not merely one of the
same hidden size: two tiny checkpoints of one shape and different weights are told apart at start (the
decoder refuses to serve), at the first encoder part when the encoder did not answer at start
(every part refused, naming both models), and in every reply: of two encoders balanced, the one of
another model has each of its parts refused while the other's are served.

Before, a decoder beside an encoder of another model took its rows and answered from the wrong model's
hidden space as if nothing were amiss; and once checked (asking one of its encoders), never again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from common.tests.ports import free_port
from tandem.client.client import EncoderPart
from tandem.client.errors import FailedPrecondition
from tandem.client.pb.tandem.v1 import encoder_pb2
from tandem.common.server import ServerOptions
from tandem.common.torch_part import tensors
from tandem.common.torch_part.prompt_parts import EncoderPrompt
from tandem.common.torch_part.random_model import make_model
from tandem.decoder.api.encoder_parts import EncoderMismatch, EncoderParts
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.models.loader import LoadedModel
from tandem.encoder.config import EncoderConfig
from tandem.encoder.lookup import LookupEmbedder
from tests.integration.decoder.conftest import serve, shutdown
from tests.integration.encoder.conftest import MAX_MESSAGE_BYTES, Encoder, start_encoder, stop_encoder

OTHER_NAME = "tiny-other"


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's shape, config and tokenizer, with other weights (seed 1, not 0)."""
    return make_model(tmp_path_factory.mktemp("other") / OTHER_NAME, seed=1)


def _other_config(other_model: Path, port: int = 0) -> EncoderConfig:
    return EncoderConfig(
        model_dir=other_model,
        model_name=OTHER_NAME,
        server=ServerOptions(host="127.0.0.1", port=port, max_message_bytes=MAX_MESSAGE_BYTES),
    )


async def _start_other(other_model: Path, port: int = 0) -> Encoder:
    return await start_encoder(
        _other_config(other_model, port), LookupEmbedder.load(other_model, torch.bfloat16)
    )


@pytest.fixture
async def other_encoder(other_model: Path) -> AsyncIterator[Encoder]:
    running = await _start_other(other_model)
    try:
        yield running
    finally:
        await stop_encoder(running)


def _parts(address: str, model_dir: Path) -> EncoderParts:
    return EncoderParts(address, torch.float32, MAX_MESSAGE_BYTES, 0, model_dir=model_dir, model_name="tiny")


async def _shape(encoder: Encoder) -> tuple[int, int]:
    info = await encoder.stub.GetModelInfo(encoder_pb2.EncoderGetModelInfoRequest())
    return info.vocab_size, info.hidden_size


def _refusal(address: str, decoder_name: str, model_dir: Path, shape: tuple[int, int]) -> str:
    return (
        f"encoder {address} serves model 'tiny-other', not this decoder's {decoder_name!r} ({model_dir}): "
        f"same token table shape [{shape[0]}, {shape[1]}], different values, so its rows would be read in "
        "the wrong model's hidden space; start the encoder with this decoder's --model"
    )


PARTS_LOG = "tandem.decoder.api.encoder_parts"  # once for the two parts: a line in 10 s at most


def _told(decoder_name: str, shape: tuple[int, int]) -> str:
    """What a caller is told: the two models, not the encoder's address nor this host's checkpoint."""
    return (
        f"the encoder serves model 'tiny-other', not this decoder's {decoder_name!r}: same token table shape "
        f"[{shape[0]}, {shape[1]}], different values, so its rows would be read in the wrong model's hidden "
        "space"
    )


async def test_an_encoder_of_another_model_of_the_same_shape_is_refused_naming_both(
    tiny_model: Path, other_encoder: Encoder, encoder: Encoder
) -> None:
    shape = await _shape(other_encoder)
    assert shape == await _shape(encoder)  # all that told them apart before: the same
    wrong = _parts(other_encoder.server.address, tiny_model)
    try:
        with pytest.raises(EncoderMismatch) as error:
            await wrong.check_model(5.0)
    finally:
        await wrong.close()
    assert str(error.value) == _refusal(other_encoder.server.address, "tiny", tiny_model, shape)
    right = _parts(encoder.server.address, tiny_model)
    try:
        assert await right.check_model(5.0) == (
            f"encoder {encoder.server.address} serves 'tiny-qwen3', this decoder's model"
        )
    finally:
        await right.close()


async def test_an_encoder_absent_at_start_is_checked_at_its_first_part_and_every_part_refused(
    tiny_model: Path, other_model: Path, tiny_fp32: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=PARTS_LOG)
    port = free_port()
    address = f"127.0.0.1:{port}"
    parts = _parts(address, tiny_model)
    assert await parts.check_model(0.5) == (
        f"encoder {address} did not answer within 0.5 s: which model it serves is checked at its first "
        "encoder part"
    )
    other = await _start_other(other_model, port)
    decoder = await serve(tiny_model, tiny_fp32, encoder_parts=parts)
    try:
        for _ in range(2):  # every part, not only the first
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for _ in decoder.client.generate(["a", EncoderPart(text="a cat")], max_new_tokens=2):
                    pass
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert error.value.details() == "prompt[1].encoder: " + _told("tiny", await _shape(other))
        # The operator's line names the encoder and the checkpoint, which the caller's does not.
        said = _refusal(address, "tiny", tiny_model, await _shape(other))
        assert [r.getMessage() for r in caplog.records if r.name == PARTS_LOG] == [said]
    finally:
        await shutdown(decoder)
        await parts.close()
        await stop_encoder(other)


async def test_of_two_encoders_balanced_every_part_the_wrong_one_embeds_is_refused_and_never_served(
    tiny_model: Path, other_encoder: Encoder, encoder: Encoder
) -> None:
    """`--encoder good,wrong`: the start-up check asked one of the two, after which half the parts were
    the wrong model's rows, served OK (10 of 20 texts in the attacker's run)."""
    parts = _parts(f"{encoder.server.address},{other_encoder.server.address}", tiny_model)
    served: list[tuple[str, torch.Tensor]] = []
    refused: list[FailedPrecondition] = []
    try:
        # Until each encoder has embedded some: the channel balances over those it has connected to.
        for round_ in range(10):
            if encoder.servicer.num_embeds and other_encoder.servicer.num_embeds:
                break
            texts = [f"sentence {round_}.{i} about foxes" for i in range(4)]
            spec, _ = parts.start(GenerateSpec(prompt=[EncoderPrompt("text", t) for t in texts]), None, 10)
            fetched = [asyncio.wrap_future(p.rows) for p in spec.prompt if isinstance(p, EncoderPrompt)]
            for i, (text, rows) in enumerate(
                zip(texts, await asyncio.gather(*fetched, return_exceptions=True), strict=True)
            ):
                if isinstance(rows, FailedPrecondition):
                    assert rows.field == f"prompt[{i}].encoder"
                    refused.append(rows)
                else:
                    assert isinstance(rows, torch.Tensor), rows
                    served.append((text, rows))
    finally:
        await parts.close()
    num_right, num_wrong = encoder.servicer.num_embeds, other_encoder.servicer.num_embeds
    assert num_right >= 1 and num_wrong >= 1
    assert len(served) == num_right  # served: every part the right encoder embedded, and no other
    assert len(refused) >= num_wrong  # refused: every one the wrong one did (and any it told its model)
    for text, rows in served:
        right = await encoder.stub.Embed(encoder_pb2.EmbedRequest(text=text))
        assert torch.equal(rows, tensors.decode(right.embeddings).float())
    told = _told("tiny", await _shape(other_encoder))
    assert all(error.description == told for error in refused)


async def _decoder_process(model_dir: Path, encoder_address: str) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    return await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "tandem.decoder", "--model", str(model_dir), "--dtype", "float32"),
        *("--port", str(free_port()), "--encoder", encoder_address, "--num-kv-blocks", "64"),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )


async def test_the_decoder_command_refuses_to_start_beside_an_encoder_of_another_model(
    tiny_model: Path, other_encoder: Encoder, encoder: Encoder
) -> None:
    process = await _decoder_process(tiny_model, other_encoder.server.address)
    output, _ = await asyncio.wait_for(process.communicate(), timeout=120)
    log = output.decode(errors="replace")
    assert process.returncode == 1, log
    refusal = _refusal(other_encoder.server.address, tiny_model.name, tiny_model, await _shape(other_encoder))
    assert f"decoder ERROR refusing --encoder: {refusal}\n" in log, log
    assert "Traceback" not in log and "serving" not in log, log
    # Beside an encoder of its own model, the same command serves.
    process = await _decoder_process(tiny_model, encoder.server.address)
    try:
        assert process.stdout is not None
        lines: list[str] = []
        while not lines or " serving " not in lines[-1]:
            line = (await asyncio.wait_for(process.stdout.readline(), timeout=120)).decode(errors="replace")
            assert line, "".join(lines)
            lines.append(line)
        assert f"encoder {encoder.server.address} serves 'tiny-qwen3', this decoder's model" in "".join(lines)
    finally:
        process.terminate()
        await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0
