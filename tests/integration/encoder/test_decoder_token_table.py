"""The encoder's rows are the decoder's own: the lookup embedder's and the vision-language embedder's
text rows equal the decoder's token table (quantized too), and rows sent as embeddings reproduce the
token path's logits. Both services on one checkpoint, so these live with the cross-service tests."""

from pathlib import Path

import pytest
import torch

from services.encoder.tests.vision_checkpoints import make_llava
from tandem.decoder.models.attention import AttentionMetadata
from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.loader import load_model
from tandem.encoder.embedder import Pooling
from tandem.encoder.lookup import LookupEmbedder
from tandem.encoder.vision.embedder import VisionLanguageEmbedder

TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_equal_the_decoders_embed_tokens(tiny_model_dir: Path, dtype: str) -> None:
    decoder = load_model(tiny_model_dir, dtype=dtype)
    embedder = LookupEmbedder.load(tiny_model_dir, getattr(torch, dtype))
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
    tiny_model_dir: Path, dtype: str, scheme: str, group: int
) -> None:
    # --quantization int8 / int4 rounds the decoder's token table (the tied head's weight), 8-bit per
    # row whatever the linears' group: the encoder, told the scheme, returns the decoder's own rows.
    decoder = load_model(tiny_model_dir, dtype=dtype, quantization=scheme, group_size=group)
    embedder = LookupEmbedder.load(tiny_model_dir, getattr(torch, dtype), scheme)
    ids = embedder.tokenize(TEXT, add_special_tokens=False)
    expected = decoder.model.embed_tokens(torch.tensor(ids))
    assert torch.equal(embedder.embed(ids, Pooling.NONE), expected)
    assert not torch.equal(expected, load_model(tiny_model_dir, dtype=dtype).model.embed_tokens.weight[ids])


def test_rows_sent_as_embeddings_reproduce_the_token_path(tiny_model_dir: Path) -> None:
    decoder = load_model(tiny_model_dir, dtype="bfloat16")
    embedder = LookupEmbedder.load(tiny_model_dir, torch.bfloat16)
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
        batch = ForwardBatch(
            input_ids,
            torch.arange(num_tokens, dtype=torch.int32),
            attn,
            inputs_embeds=None if is_token_ids else rows,
            is_token_ids=torch.full((num_tokens,), is_token_ids),
        )
        kv_caches = decoder.model.allocate_kv_cache(num_blocks=2, block_size=block_size)
        return decoder.model(batch, kv_caches)  # [num_tokens, vocab_size]

    assert torch.equal(logits(is_token_ids=False), logits(is_token_ids=True))


def test_text_rows_follow_the_quantized_decoders_token_table(tmp_path: Path) -> None:
    """`tandem up --quantization int8` hands the scheme to both: the text rows stay the decoder's own."""
    model_dir = make_llava(tmp_path / "llava")
    decoder = load_model(model_dir, dtype="float32", quantization="int8")
    encoder = VisionLanguageEmbedder.load(model_dir, torch.float32, "int8")
    ids = [5, 17, 300, 1000]
    expected = decoder.model.embed_tokens(torch.tensor(ids))
    assert torch.equal(encoder.embed(ids, Pooling.NONE), expected)
    assert not torch.equal(
        expected, VisionLanguageEmbedder.load(model_dir, torch.float32).embed(ids, Pooling.NONE)
    )
