"""The lookup embedder reads nothing but the token table (that its rows are the decoder's own is
tests/integration/encoder/test_decoder_token_table.py's)."""

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.encoder import embedder
from tandem.encoder.embedder import EmbedderLoadError, Pooling
from tandem.encoder.lookup import EMBED_KEY, LookupEmbedder, TableShapeError

TEXT = "The quick brown fox jumps over the lazy dog."


def test_info_describes_the_checkpoint(tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    info = LookupEmbedder.load(tiny_model, torch.bfloat16).info
    assert (info.kind, info.hidden_size) == ("lookup", config["hidden_size"])
    assert info.vocab_size == config["vocab_size"]
    assert info.dtype == torch.bfloat16
    assert info.max_positions is None and info.num_virtual_tokens == 0


def test_mean_pooling_gives_one_row(tiny_model: Path) -> None:
    embedder = LookupEmbedder.load(tiny_model, torch.float32)
    ids = [5, 17, 300]
    pooled = embedder.embed(ids, Pooling.MEAN)  # [1, hidden_size]
    assert pooled.shape == (1, embedder.info.hidden_size)
    torch.testing.assert_close(pooled[0], embedder.table[ids].mean(dim=0))


def _copy_without_weights(tiny_model: Path, out_dir: Path) -> None:
    out_dir.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_model / name, out_dir / name)


def test_a_sharded_checkpoint_needs_only_the_shard_with_the_table(tiny_model: Path, tmp_path: Path) -> None:
    # Shard 2 holds the table, shard 1 is listed but missing, and no layer weights exist at all.
    sharded = tmp_path / "sharded"
    _copy_without_weights(tiny_model, sharded)
    with safe_open(tiny_model / "model.safetensors", framework="pt") as weights:
        table = weights.get_tensor(EMBED_KEY)
    save_file({EMBED_KEY: table}, str(sharded / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {
            "model.norm.weight": "model-00001-of-00002.safetensors",
            EMBED_KEY: "model-00002-of-00002.safetensors",
        },
    }
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    embedder = LookupEmbedder.load(sharded, torch.bfloat16)
    reference = LookupEmbedder.load(tiny_model, torch.bfloat16)
    assert torch.equal(embedder.table, reference.table)


def test_reads_no_tensor_but_embed_tokens(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[str] = []
    real_safe_open = embedder.safe_open  # the one reader every embedder goes through

    class RecordingHandle:
        def __init__(self, *args, **kwargs) -> None:
            self.inner = real_safe_open(*args, **kwargs)

        def __enter__(self) -> "RecordingHandle":
            self.inner.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.inner.keys()

        def get_slice(self, key: str) -> Any:  # the table's shape is read from the header, no data
            return self.inner.get_slice(key)

        def get_tensor(self, key: str) -> torch.Tensor:
            read.append(key)
            return self.inner.get_tensor(key)

    monkeypatch.setattr(embedder, "safe_open", RecordingHandle)
    LookupEmbedder.load(tiny_model, torch.bfloat16)
    assert read == [EMBED_KEY]


def test_missing_table_is_a_clear_error(tiny_model: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    _copy_without_weights(tiny_model, broken)
    save_file({"model.norm.weight": torch.ones(4)}, str(broken / "model.safetensors"))
    with pytest.raises(EmbedderLoadError, match="model.embed_tokens.weight not found"):
        LookupEmbedder.load(broken, torch.bfloat16)


def test_a_table_of_another_shape_than_config_json_says_is_refused_from_its_header(
    tiny_model: Path, tmp_path: Path
) -> None:
    """What the __main__ checks before listening, checked again by the load (the files may change)."""
    broken = Path(shutil.copytree(tiny_model, tmp_path / "broken"))
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(config | {"vocab_size": config["vocab_size"] + 64}))
    with pytest.raises(TableShapeError, match=r"has shape \[1024, 64\] in the file, but config.json implies"):
        LookupEmbedder.load(broken, torch.bfloat16)


@pytest.mark.parametrize("stored", [torch.int32, torch.float8_e4m3fn, torch.uint8])
def test_a_table_stored_as_integer_or_fp8_data_is_refused_from_its_header(
    tiny_model: Path, tmp_path: Path, stored: torch.dtype
) -> None:
    """Quantized data (GPTQ's packed int32, FP8 beside a scale) cast to the serving dtype would be other
    numbers than the decoder's rows, which refuses such a checkpoint; the encoder alone served them."""
    broken = tmp_path / "broken"
    _copy_without_weights(tiny_model, broken)
    with safe_open(tiny_model / "model.safetensors", framework="pt") as weights:
        table = weights.get_tensor(EMBED_KEY)  # [vocab_size, hidden_size]
    save_file({EMBED_KEY: table.to(stored)}, str(broken / "model.safetensors"))
    with pytest.raises(TableShapeError, match=rf"weight {EMBED_KEY} is stored as \w+, not a type a weight"):
        LookupEmbedder.load(broken, torch.bfloat16)


@pytest.mark.parametrize("method", ["fp8", "bitsandbytes"])
def test_a_checkpoint_whose_config_names_a_quantization_is_refused_as_the_decoder_refuses_it(
    tiny_model: Path, tmp_path: Path, method: str
) -> None:
    """A quantized checkpoint's table is often left in bf16 (the decoder then refuses its projections),
    and a bitsandbytes one holds float weights its loader quantizes: the encoder served such a table
    beside a decoder that refused the checkpoint. Its words are the decoder's, but for what serves
    instead: the encoder's --quantization refuses gguf, so gguf is named as the decoder's flag."""
    quantized = Path(shutil.copytree(tiny_model, tmp_path / "quantized"))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(TableShapeError) as raised:
        LookupEmbedder.load(quantized, torch.bfloat16)
    assert str(raised.value) == (
        f"{quantized / 'config.json'}: quantization_config.quant_method is {method!r}: the weights are "
        "stored for that quantization's own loader, which Tandem has not. Serve the bf16, fp16 or fp32 "
        "checkpoint it was quantized from (with the decoder's --quantization int8 or int4 here too, to "
        "round the table alike), or a GGUF file as --model, which the decoder serves with --quantization "
        "gguf (docs/DEPLOYMENT.md)"
    )


def test_an_index_placing_the_table_outside_the_checkpoint_is_refused(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The token table's file would have been read from anywhere the index says (another model's)."""
    broken = tmp_path / "broken"
    _copy_without_weights(tiny_model, broken)
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.copy(tiny_model / "model.safetensors", elsewhere)
    index = {"weight_map": {EMBED_KEY: "../elsewhere.safetensors"}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(EmbedderLoadError, match="'../elsewhere.safetensors' lies outside the checkpoint"):
        LookupEmbedder.load(broken, torch.bfloat16)


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EmbedderLoadError, match="does not exist"):
        LookupEmbedder.load(tmp_path / "nowhere", torch.bfloat16)


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text.replace('"', '"\\ud800', 1).encode(),  # a lone surrogate in a JSON string
        lambda text: b"\xff" + text.encode(),  # no UTF-8
    ],
    ids=["lone-surrogate", "not-utf8"],
)
def test_a_tokenizer_file_the_library_cannot_read_is_a_load_error_naming_it(
    tiny_model: Path, tmp_path: Path, damage: Any
) -> None:
    # The tokenizers library raises a plain Exception: a traceback at start, the file unnamed.
    broken = Path(shutil.copytree(tiny_model, tmp_path / "broken"))
    path = broken / "tokenizer.json"
    path.write_bytes(damage(path.read_text()))
    with pytest.raises(EmbedderLoadError) as raised:
        LookupEmbedder.load(broken, torch.bfloat16)
    assert str(raised.value).startswith(f"{path}: not a tokenizer the tokenizers library reads: ")


def test_a_tokenizer_given_is_served_and_the_file_not_parsed_again(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The __main__ parses tokenizer.json before listening: 65-290 ms each time for SmolLM2's 3.5 MB."""
    from tandem.encoder import lookup

    tokenizer = lookup.read_tokenizer(tiny_model)
    monkeypatch.setattr(lookup, "read_tokenizer", lambda model_dir: pytest.fail("parsed again"))
    assert LookupEmbedder.load(tiny_model, torch.float32, tokenizer=tokenizer).tokenizer is tokenizer
