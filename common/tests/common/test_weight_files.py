"""Which file of a checkpoint holds each weight: the single file's names, or the shard its index names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tandem.common.torch_part.weight_files import INDEX_NAME, weight_names


def test_every_weight_of_a_single_file_is_in_model_safetensors(tmp_path: Path) -> None:
    save_file({"a.weight": torch.zeros(2), "b.weight": torch.ones(3)}, tmp_path / "model.safetensors")
    assert weight_names(tmp_path, ValueError) == dict.fromkeys(
        ["a.weight", "b.weight"], tmp_path / "model.safetensors"
    )


def test_each_weight_of_a_sharded_checkpoint_is_in_the_shard_its_index_names(tmp_path: Path) -> None:
    weight_map = {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.weight": "model-00002-of-00002.safetensors",
    }
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert weight_names(tmp_path, ValueError) == {name: tmp_path / file for name, file in weight_map.items()}


def test_a_directory_without_weights_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"model.safetensors \\(or {INDEX_NAME}\\) not found in {tmp_path}"):
        weight_names(tmp_path, ValueError)


@pytest.mark.parametrize("weight_map", [["model.safetensors"], {"a.weight": 3}])
def test_an_index_whose_weight_map_names_no_files_is_an_error_naming_it(
    tmp_path: Path, weight_map: object
) -> None:
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="weight_map must map weight names to file names"):
        weight_names(tmp_path, ValueError)


@pytest.mark.parametrize("file", ["/etc/passwd", "../other/model.safetensors", "..", "shards/../../x"])
def test_an_index_naming_a_file_outside_the_checkpoint_is_an_error_naming_it(
    tmp_path: Path, file: str
) -> None:
    """Either service would have opened it as a weight file (the encoder's token table, a tower's
    weights, the decoder's model)."""
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"a.weight": file}}))
    with pytest.raises(ValueError, match=f"file {file!r} lies outside the checkpoint directory"):
        weight_names(tmp_path, ValueError)


def test_a_shard_name_is_judged_as_written_not_where_its_link_leads(tmp_path: Path) -> None:
    """A Hugging Face cache snapshot's files are links into its blobs directory, outside the snapshot."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    save_file({"a.weight": torch.zeros(2)}, blobs / "abc123")
    (snapshot / "model-00001-of-00001.safetensors").symlink_to(blobs / "abc123")
    (snapshot / INDEX_NAME).write_text(
        json.dumps({"weight_map": {"a.weight": "model-00001-of-00001.safetensors"}})
    )
    assert weight_names(snapshot, ValueError) == {"a.weight": snapshot / "model-00001-of-00001.safetensors"}
