"""Safetensors weights indexed from their headers and read into the model: sharded, linked, malformed,
not finite, and the progress a long load logs."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.decoder.models import loader, safetensors_weights
from tandem.decoder.models.loader import ModelLoadError, load_model

from ..conftest import Checkpoint
from .checkpoint_copies import copy_of, edit_json, edit_weights
from .helpers import PagedRun


def test_sharded_checkpoint_loads_the_same_model(
    checkpoints: dict[str, Checkpoint], hf_checkpoint_factory: Any
) -> None:
    sharded = hf_checkpoint_factory("llama3", max_shard_size="100KB")
    assert len(json.loads((sharded.path / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(sharded.path.glob("model-*.safetensors"))) > 2
    single = load_model(checkpoints["llama3"].path, dtype="float32").model
    model = load_model(sharded.path, dtype="float32").model
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), single.state_dict().values(), strict=True)
    )
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert torch.equal(PagedRun(model).step([(0, prompt)]), PagedRun(single).step([(0, prompt)]))


def test_missing_shard_is_named(hf_checkpoint_factory: Any) -> None:
    sharded = hf_checkpoint_factory("qwen3", max_shard_size="100KB")
    shard = sorted(sharded.path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(sharded.path)


def test_loading_logs_its_progress_and_a_summary(
    checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A large checkpoint says how far it got every PROGRESS_INTERVAL_S; here every weight does."""
    monkeypatch.setattr(safetensors_weights, "PROGRESS_INTERVAL_S", 0.0)
    with caplog.at_level(logging.INFO, logger=safetensors_weights.__name__):
        model = load_model(checkpoint.path, dtype="float32").model
    lines = [r.getMessage() for r in caplog.records if r.name == safetensors_weights.__name__]
    num_weights = len(list(model.parameters()))
    progress = [re.match(r"loading weights: (\d+)/(\d+) \((\d+)%", line) for line in lines[:-1]]
    assert all(progress) and [int(m.group(1)) for m in progress] == list(range(1, num_weights))
    assert {int(m.group(2)) for m in progress} == {num_weights}
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert re.fullmatch(rf"loaded {num_weights} weights \({num_bytes / 1e9:.2f} GB\) in \d+\.\d s", lines[-1])


def split_safetensors(path: Path) -> tuple[bytes, bytes]:
    """(header JSON, tensor bytes) of a safetensors file: its first 8 bytes give the header's length."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return data[8 : 8 + length], data[8 + length :]


def with_header(header: bytes, body: bytes, length: int | None = None) -> bytes:
    return (len(header) if length is None else length).to_bytes(8, "little") + header + body


def overlapping_offsets(header: bytes, body: bytes) -> bytes:
    meta = json.loads(header)
    meta["model.norm.weight"]["data_offsets"] = meta["model.embed_tokens.weight"]["data_offsets"]
    return with_header(json.dumps(meta).encode(), body)


MALFORMED_FILES = {
    "header length past the end": lambda h, b: with_header(h, b, length=1 << 40),
    "header length 2^63": lambda h, b: with_header(h, b, length=1 << 63),
    "header that is no JSON": lambda h, b: with_header(b"not json" + b" " * (len(h) - 8), b),
    "header nested 100,000 deep": lambda h, b: with_header(b"[" * 100_000 + b"]" * 100_000, b),
    "tensor bytes cut short": lambda h, b: with_header(h, b[:-1000]),
    "overlapping offsets": overlapping_offsets,
    "empty file": lambda h, b: b"",
}


@pytest.mark.parametrize("case", list(MALFORMED_FILES))
def test_a_malformed_safetensors_file_is_named_before_the_server_listens(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, case: str
) -> None:
    """check_checkpoint (run before listening) parses every header; safetensors' own error, a bare
    Exception, escaped the decoder's start-up as a traceback."""
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    path = model_dir / "model.safetensors"
    path.write_bytes(MALFORMED_FILES[case](*split_safetensors(path)))
    with pytest.raises(ModelLoadError, match=rf"{re.escape(str(path))} is not a readable safetensors file"):
        loader.check_checkpoint(model_dir)


@pytest.mark.parametrize("name", ["/etc/passwd", "../elsewhere/model.safetensors", "sub/../../x.safetensors"])
def test_an_index_naming_a_file_outside_the_directory_is_refused(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, name: str
) -> None:
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(ModelLoadError, match=rf"file {re.escape(repr(name))} lies outside the checkpoint"):
        loader.check_checkpoint(model_dir)


@pytest.mark.parametrize("weight_map", [["model.safetensors"], {"w": 5}, "model.safetensors"])
def test_an_index_whose_weight_map_is_not_names_to_files_is_refused(
    checkpoints: dict[str, Checkpoint], tmp_path: Path, weight_map: Any
) -> None:
    model_dir = copy_of(checkpoints["qwen3"], tmp_path)
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match="weight_map must map weight names to file names"):
        loader.check_checkpoint(model_dir)


def test_a_weight_in_two_shards_is_named_with_both(hf_checkpoint_factory: Any) -> None:
    sharded = hf_checkpoint_factory("qwen3", max_shard_size="100KB")
    first, second = sorted(sharded.path.glob("model-*.safetensors"))[:2]
    name = "model.norm.weight"
    for shard in (first, second):  # wherever the norm was, the first two shards now both hold it
        save_file(load_file(shard) | {name: torch.ones(64)}, shard)
    with pytest.raises(ModelLoadError, match=rf"weight {name} is in both {first.name} and {second.name}"):
        loader.check_checkpoint(sharded.path)


def test_weights_of_layers_past_num_hidden_layers_are_refused(
    checkpoints: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """A config that says fewer layers than the file holds served the first layers alone: noise."""
    model_dir = copy_of(checkpoints["llama3"], tmp_path)
    edit_json(model_dir / "config.json", num_hidden_layers=1)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.\S+ is of layer 1, but config\.json's "):
        loader.check_checkpoint(model_dir)


@pytest.mark.parametrize(
    ("name", "index", "value", "dtype", "message"),
    [
        (
            "model.embed_tokens.weight",
            (5, 3),
            float("nan"),
            "float32",
            r"holds nan at \[5, 3\] in torch.float32$",
        ),
        # k_proj is fused after q_proj's 64 rows: the error names the checkpoint's tensor and row.
        (
            "model.layers.1.self_attn.k_proj.weight",
            (3, 7),
            float("-inf"),
            "bfloat16",
            r"holds -inf at \[3, 7\] in torch.bfloat16$",
        ),
        (
            "model.norm.weight",
            (2,),
            3e38,
            "float16",
            r"holds inf at \[2\] in torch.float16 \(3e\+38 in the file\)",
        ),
    ],
)
def test_a_weight_that_is_not_finite_in_the_model_dtype_is_named(
    checkpoints: dict[str, Checkpoint],
    tmp_path: Path,
    name: str,
    index: tuple[int, ...],
    value: float,
    dtype: str,
    message: str,
) -> None:
    """One NaN or Inf weight can make every logit NaN (each request then ends INTERNAL from a server
    that said it was ready); a finite float32 value past float16's range is Inf once cast."""
    model_dir = copy_of(checkpoints["llama3"], tmp_path)

    def poison(weights: dict[str, torch.Tensor]) -> None:
        weights[name][index] = value

    edit_weights(model_dir, poison)
    with pytest.raises(ModelLoadError, match=rf"weight {re.escape(name)} {message}"):
        load_model(model_dir, dtype=dtype)


def test_shards_that_are_links_out_of_the_directory_load_as_in_a_hugging_face_cache(
    hf_checkpoint_factory: Any, tmp_path: Path
) -> None:
    """A hub snapshot's files are symbolic links into ../../blobs: the index's names are judged as
    written, so the files they lead to load."""
    sharded = hf_checkpoint_factory("qwen3", max_shard_size="100KB")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in sharded.path.glob("model-*.safetensors"):
        shard.rename(blobs / shard.name)
        shard.symlink_to(blobs / shard.name)
    assert load_model(sharded.path, dtype="float32").config.num_layers == 2
