"""The servicer's validation and delegation, called directly (no transport; errors raise)."""

import asyncio
import json
import re
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image

from services.encoder.tests.helpers import write_prompt_adapter
from services.encoder.tests.vision_checkpoints import make_image
from tandem.client.errors import InvalidArgument, Unavailable
from tandem.client.pb.tandem.v1 import encoder_pb2, tensor_pb2
from tandem.common.server import ServerOptions
from tandem.common.torch_part import tensors
from tandem.encoder import __main__ as encoder_main
from tandem.encoder.__main__ import main
from tandem.encoder.config import EncoderConfig
from tandem.encoder.embedder import EmbedderInfo, EmbedderLoadError, Pooling
from tandem.encoder.loader import load_embedder
from tandem.encoder.lookup import LookupEmbedder
from tandem.encoder.servicer import EncoderServicer
from tandem.encoder.vision.embedder import VisionLanguageEmbedder
from tandem.encoder.vision.image_span import PreparedImage


def _servicer(config: EncoderConfig) -> EncoderServicer:
    servicer = EncoderServicer(config)
    servicer.attach(load_embedder(config))
    return servicer


async def test_rpcs_are_unavailable_until_an_embedder_is_attached(tiny_model: Path) -> None:
    servicer = EncoderServicer(EncoderConfig(model_dir=tiny_model))
    with pytest.raises(Unavailable):
        await servicer.GetModelInfo(encoder_pb2.EncoderGetModelInfoRequest(), None)
    servicer.close()


async def test_soft_prompt_rows_precede_the_text_and_only_text_ids_are_listed(
    tiny_model: Path, tmp_path: Path
) -> None:
    prompt = write_prompt_adapter(tmp_path / "adapter", num_virtual_tokens=4, token_dim=64)
    config = EncoderConfig(model_dir=tiny_model, embedder="soft-prompt", adapter_dir=tmp_path / "adapter")
    servicer = _servicer(config)
    try:
        info = await servicer.GetModelInfo(encoder_pb2.EncoderGetModelInfoRequest(), None)
        assert (info.embedder, info.num_virtual_tokens) == ("soft-prompt", 4)
        request = encoder_pb2.EmbedRequest(text="hello", output_dtype=tensor_pb2.DATA_TYPE_FLOAT32)
        reply = await servicer.Embed(request, None)
        rows = tensors.decode(reply.embeddings)  # [4 + num_tokens, 64]
        assert rows.shape[0] == 4 + len(reply.token_ids.ids) == 4 + reply.usage.input_tokens
        assert torch.equal(rows[:4], prompt.to(torch.bfloat16).float())
    finally:
        servicer.close()


async def test_configured_pooling_applies_when_the_request_leaves_it_unspecified(tiny_model: Path) -> None:
    servicer = _servicer(EncoderConfig(model_dir=tiny_model, pooling=Pooling.MEAN))
    try:
        pooled = await servicer.Embed(encoder_pb2.EmbedRequest(text="a b c d"), None)
        assert list(pooled.embeddings.shape) == [1, 64]
        request = encoder_pb2.EmbedRequest(text="a b c d", pooling=encoder_pb2.POOLING_NONE)
        per_token = await servicer.Embed(request, None)
        assert per_token.embeddings.shape[0] == len(per_token.token_ids.ids) > 1
    finally:
        servicer.close()


async def test_response_over_the_message_limit_is_refused_before_embedding(tiny_model: Path) -> None:
    # 64 float32 columns = 256 bytes a row: 40 rows and their IDs overflow an 8 KiB message.
    config = EncoderConfig(model_dir=tiny_model, server=ServerOptions(max_message_bytes=8192))
    servicer = _servicer(config)
    try:
        request = encoder_pb2.EmbedRequest(
            token_ids=tensor_pb2.TokenIds(ids=[1] * 40), output_dtype=tensor_pb2.DATA_TYPE_FLOAT32
        )
        with pytest.raises(InvalidArgument, match="over max_message_bytes 8192") as caught:
            await servicer.Embed(request, None)
        assert caught.value.field == "token_ids"
    finally:
        servicer.close()


async def test_max_input_tokens_is_capped_by_the_embedder(tiny_model: Path) -> None:
    class ShortLookup(LookupEmbedder):
        """Reads at most 512 positions, like a BERT encoder."""

        @property
        def info(self) -> EmbedderInfo:
            return replace(super().info, max_positions=512)

    servicer = EncoderServicer(EncoderConfig(model_dir=tiny_model, max_input_tokens=1000))
    servicer.attach(ShortLookup.load(tiny_model, torch.bfloat16))
    try:
        info = await servicer.GetModelInfo(encoder_pb2.EncoderGetModelInfoRequest(), None)
        assert info.max_input_tokens == 512
    finally:
        servicer.close()


def test_main_exits_2_with_one_line_naming_the_flag_when_the_model_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], environ
) -> None:
    assert main(["--model", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        f"tandem serve encoder: --model (TANDEM_ENCODER_MODEL): model {tmp_path / 'missing'} does not exist "
        "(a checkpoint directory or a .gguf file)\n"
    )
    assert main(["--model", str(tmp_path), "--port", "0"]) == 2  # a directory, but not a checkpoint
    assert capsys.readouterr().err == (
        f"tandem serve encoder: --model (TANDEM_ENCODER_MODEL): model {tmp_path} is a directory without "
        "config.json: not a checkpoint directory\n"
    )


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size"])
def test_main_exits_2_before_listening_when_config_json_disagrees_with_the_token_table(
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    environ,
    key: str,
) -> None:
    """The table's shape comes from its file's header, before the port opens; it was refused by the
    load, after the server listened (exit 1)."""
    broken = Path(shutil.copytree(tiny_model, tmp_path / "broken"))
    config = json.loads((broken / "config.json").read_text())
    stored = [config["vocab_size"], config["hidden_size"]]
    config[key] += 64
    (broken / "config.json").write_text(json.dumps(config))
    servers: list[object] = []
    monkeypatch.setattr(encoder_main, "start_server", lambda *args: servers.append(args))
    assert main(["--model", str(broken), "--port", "0"]) == 2
    vocab_size, hidden_size = config["vocab_size"], config["hidden_size"]
    assert capsys.readouterr().err == (
        f"tandem serve encoder: --model (TANDEM_ENCODER_MODEL): {broken / 'model.safetensors'}: weight "
        f"model.embed_tokens.weight has shape {stored} in the file, but config.json implies "
        f"[{vocab_size}, {hidden_size}] (vocab_size {vocab_size}, hidden_size {hidden_size})\n"
    )
    assert servers == []  # no port was bound


def test_main_exits_2_before_listening_when_a_llava_text_config_disagrees_with_its_token_table(
    tiny_llava: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    environ,
) -> None:
    broken = Path(shutil.copytree(tiny_llava, tmp_path / "broken"))
    config = json.loads((broken / "config.json").read_text())
    vocab_size = config["text_config"]["vocab_size"]
    config["text_config"]["vocab_size"] = vocab_size + 64
    (broken / "config.json").write_text(json.dumps(config))
    servers: list[object] = []
    monkeypatch.setattr(encoder_main, "start_server", lambda *args: servers.append(args))
    assert main(["--model", str(broken), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"tandem serve encoder: --model (TANDEM_ENCODER_MODEL): {broken}")
        and err.count("\n") == 1
    )
    assert re.search(
        rf"weight \S*embed_tokens\.weight has shape \[{vocab_size}, 64\] in the file, but config\.json "
        rf"implies \[{vocab_size + 64}, 64\] \(vocab_size {vocab_size + 64}, hidden_size 64\)\n$",
        err,
    ), err
    assert servers == []


def test_main_exits_2_with_one_line_naming_model_when_config_json_lacks_a_size(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], environ
) -> None:
    """A checkpoint directory in name only: refused by the load, after the server listened (exit 1)."""
    (tmp_path / "config.json").write_text("{}")
    shutil.copy(tiny_model / "tokenizer.json", tmp_path)
    assert main(["--model", str(tmp_path), "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        f"tandem serve encoder: --model (TANDEM_ENCODER_MODEL): config.json in {tmp_path}: hidden_size must "
        "be a positive integer, got None\n"
    )


def test_main_exits_1_with_one_line_when_the_embedder_cannot_be_loaded(
    tiny_model: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, environ
) -> None:
    """Files that checked out at start but fail to load (changed since, or a read failing)."""

    def fails(*args: object) -> None:
        raise EmbedderLoadError(f"{tiny_model / 'model.safetensors'}: the read failed")

    monkeypatch.setattr(encoder_main, "load_embedder", fails)
    assert main(["--model", str(tiny_model), "--port", "0"]) == 1
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [r.getMessage().split(":")[0] for r in errors] == ["could not load the lookup embedder"]
    assert all(r.exc_info is None for r in caplog.records)  # a line, not a traceback


async def test_a_text_too_long_to_fit_is_refused_from_its_length_before_it_is_tokenized(
    tiny_model: Path,
) -> None:
    # Tokenizing 30 MB of text held the encoder's event loop for 27 s (encode holds the GIL).
    class CountingLookup(LookupEmbedder):
        num_tokenized = 0

        def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
            CountingLookup.num_tokenized += 1
            return super().tokenize(text, add_special_tokens)

    servicer = EncoderServicer(EncoderConfig(model_dir=tiny_model, max_input_tokens=64))
    servicer.attach(CountingLookup.load(tiny_model, torch.bfloat16))
    max_chars = servicer._require_embedder().info.max_token_chars
    try:
        with pytest.raises(InvalidArgument, match="at least 65 positions") as caught:
            await servicer.Embed(encoder_pb2.EmbedRequest(text="a" * (64 * max_chars + 1)), None)
        assert caught.value.field == "text"
        with pytest.raises(InvalidArgument) as caught:
            await servicer.Tokenize(
                encoder_pb2.EncoderTokenizeRequest(texts=["a" * 64 * max_chars, "b"]), None
            )
        assert caught.value.field == "texts"
        assert CountingLookup.num_tokenized == 0
        reply = await servicer.Embed(encoder_pb2.EmbedRequest(text="the quiet harbour"), None)
        assert reply.usage.input_tokens >= 1 and CountingLookup.num_tokenized == 1
    finally:
        servicer.close()


class GatedVisionEmbedder(VisionLanguageEmbedder):
    """A real tiny LLaVA whose first image's preprocessing waits for the test; counts what it prepares."""

    num_prepared = 0
    first_started: threading.Event
    first_may_finish: threading.Event

    def prepare_image(self, image: Image.Image) -> PreparedImage:
        self.num_prepared += 1
        if self.num_prepared == 1:
            self.first_started.set()
            self.first_may_finish.wait(5)
        return super().prepare_image(image)


def _gated(model_dir: Path) -> GatedVisionEmbedder:
    embedder = GatedVisionEmbedder.load(model_dir, torch.float32)
    embedder.first_started, embedder.first_may_finish = threading.Event(), threading.Event()
    return embedder


def _image_request(path: Path) -> encoder_pb2.EmbedRequest:
    return encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=path.read_bytes()))


async def test_an_image_whose_call_is_cancelled_while_its_batch_runs_is_never_preprocessed(
    tiny_llava: Path, tmp_path: Path
) -> None:
    servicer = EncoderServicer(EncoderConfig(model_dir=tiny_llava, dtype="float32", max_batch_wait_ms=500))
    embedder = _gated(tiny_llava)
    servicer.attach(embedder)
    requests = [
        _image_request(make_image(tmp_path / f"{i}.png", (30 + 10 * i, 41), seed=i)) for i in range(3)
    ]
    try:
        calls = [asyncio.ensure_future(servicer.Embed(request, None)) for request in requests]
        assert await asyncio.to_thread(embedder.first_started.wait, 5)  # the batch of three runs
        calls[1].cancel()  # as gRPC does when its caller cancels or its deadline passes
        await asyncio.sleep(0.01)
        embedder.first_may_finish.set()
        batched = [await calls[0], await calls[2]]
        with pytest.raises(asyncio.CancelledError):
            await calls[1]
        assert embedder.num_prepared == 2 and servicer._batcher.batch_sizes == [3]  # type: ignore[union-attr]
        alone = [await servicer.Embed(requests[i], None) for i in (0, 2)]
        for reply, reference in zip(batched, alone, strict=True):
            assert torch.equal(tensors.decode(reply.embeddings), tensors.decode(reference.embeddings))
    finally:
        servicer.close()


async def test_end_calls_answers_every_call_in_flight_unavailable_and_the_batch_prepares_no_further_image(
    tiny_llava: Path, tmp_path: Path
) -> None:
    servicer = EncoderServicer(EncoderConfig(model_dir=tiny_llava, dtype="float32", max_batch_size=2))
    embedder = _gated(tiny_llava)
    servicer.attach(embedder)
    requests = [_image_request(make_image(tmp_path / f"{i}.png", (36, 36), seed=i)) for i in range(3)]
    try:
        calls = [asyncio.ensure_future(servicer.Embed(request, None)) for request in requests]
        assert await asyncio.to_thread(embedder.first_started.wait, 5)  # a batch of two runs, one waits
        assert servicer.end_calls() == 3
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, Unavailable) and "shutting down" in str(r) for r in results)
        with pytest.raises(Unavailable, match="shutting down"):
            await servicer.Embed(requests[0], None)
        embedder.first_may_finish.set()
        await asyncio.to_thread(servicer._executor.shutdown)  # the batch on the worker ends
        assert embedder.num_prepared == 1  # the image it was preparing; not its neighbour's
    finally:
        embedder.first_may_finish.set()
        servicer.close()
