"""The lookup embedder reproduces the decoder's token path and reads nothing but the table."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.decoder.models.attention import AttentionMetadata
from tandem.decoder.models.loader import load_model
from tandem.encoder import embedder
from tandem.encoder.embedder import EmbedderLoadError, Pooling
from tandem.encoder.lookup import EMBED_KEY, LookupEmbedder

TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_equal_the_decoders_embed_tokens(tiny_model: Path, dtype: str) -> None:
    decoder = load_model(tiny_model, dtype=dtype)
    embedder = LookupEmbedder.load(tiny_model, getattr(torch, dtype))
    ids = embedder.tokenize(TEXT, add_special_tokens=False)
    assert ids == decoder.tokenizer.encode(TEXT, add_special_tokens=False).ids
    rows = embedder.embed(ids, Pooling.NONE)  # [num_tokens, hidden_size]
    expected = decoder.model.embed_tokens.weight[ids]
    assert rows.dtype == expected.dtype
    assert torch.equal(rows, expected)
    written = torch.full_like(expected, float("nan"))  # a caller's memory (a shared-memory segment)
    embedder.embed_into(ids, written)
    assert torch.equal(written, expected)


@pytest.mark.parametrize(("scheme", "group"), [("int8", 32), ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_equal_the_quantized_decoders_embedding(
    tiny_model: Path, dtype: str, scheme: str, group: int
) -> None:
    # --quantization int8 / int4 rounds the decoder's token table (the tied head's weight), 8-bit per
    # row whatever the linears' group: the encoder, told the scheme, returns the decoder's own rows.
    decoder = load_model(tiny_model, dtype=dtype, quantization=scheme, group_size=group)
    embedder = LookupEmbedder.load(tiny_model, getattr(torch, dtype), scheme)
    ids = embedder.tokenize(TEXT, add_special_tokens=False)
    expected = decoder.model.embed_tokens(torch.tensor(ids))
    assert torch.equal(embedder.embed(ids, Pooling.NONE), expected)
    assert not torch.equal(expected, load_model(tiny_model, dtype=dtype).model.embed_tokens.weight[ids])


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


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EmbedderLoadError, match="does not exist"):
        LookupEmbedder.load(tmp_path / "nowhere", torch.bfloat16)


def test_rows_sent_as_embeddings_reproduce_the_token_path(tiny_model: Path) -> None:
    decoder = load_model(tiny_model, dtype="bfloat16")
    embedder = LookupEmbedder.load(tiny_model, torch.bfloat16)
    ids = embedder.tokenize(TEXT, add_special_tokens=False)
    rows = embedder.embed(ids, Pooling.NONE)  # [num_tokens, hidden_size]
    num_tokens = len(ids)
    block_size = 32
    assert num_tokens <= block_size

    def logits(is_token_ids: bool) -> torch.Tensor:
        # One sequence in block 1 (block 0 is the decoder's null block), logits at every position.
        attn = AttentionMetadata(
            query_lens=[num_tokens],
            seq_lens=[num_tokens],
            seq_lens_t=torch.tensor([num_tokens], dtype=torch.int32),
            slot_mapping=torch.arange(num_tokens) + block_size,
            block_tables=torch.tensor([[1]], dtype=torch.int32),
            logits_indices=torch.arange(num_tokens),
        )
        input_ids = torch.tensor(ids if is_token_ids else [0] * num_tokens, dtype=torch.int32)
        return decoder.model(
            input_ids,
            torch.arange(num_tokens, dtype=torch.int32),
            attn,
            decoder.model.allocate_kv_cache(num_blocks=2, block_size=block_size),
            inputs_embeds=None if is_token_ids else rows,
            is_token_ids=torch.full((num_tokens,), is_token_ids),
        )  # [num_tokens, vocab_size]

    assert torch.equal(logits(is_token_ids=False), logits(is_token_ids=True))
