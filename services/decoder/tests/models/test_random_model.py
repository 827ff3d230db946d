"""Random-weight checkpoints: Hugging Face directories that transformers and our loader both load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.common.torch_part.random_model import (
    CORPUS_PATH,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_SIZE,
    make_model,
    train_tokenizer,
)
from tandem.decoder.models.loader import load_model

from .helpers import PagedRun, greedy

TEXT = 'The lighthouse keeper wrote 3 lines, then said: "Ünïcode ✓ works too!"\n\tDone.'


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny"))


def test_transformers_loads_the_tiny_checkpoint_with_no_missing_or_unexpected_keys(tiny_dir: Path) -> None:
    hf_model, info = AutoModelForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(hf_model).__name__ == "Qwen3ForCausalLM"


def test_our_logits_agree_with_transformers_on_the_tiny_checkpoint(tiny_dir: Path) -> None:
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).train(False)
    loaded = load_model(tiny_dir, dtype="float32")
    ids = loaded.tokenizer.encode(TEXT).ids
    logits = PagedRun(loaded.model).step([("s", ids)], all_logits=True)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_config_describes_the_tiny_shape(tiny_dir: Path) -> None:
    config = load_model(tiny_dir).config
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (64, 4, 2, 16)
    assert config.tie_word_embeddings and config.dtype == torch.bfloat16
    assert config.max_position_embeddings == 4096 and config.vocab_size % 64 == 0
    assert json.loads((tiny_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_tokenizer_round_trips_text_and_agrees_with_transformers(tiny_dir: Path) -> None:
    loaded = load_model(tiny_dir)
    tokenizer = loaded.tokenizer
    assert tokenizer.decode(tokenizer.encode(TEXT).ids) == TEXT
    hf_tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert hf_tokenizer(TEXT)["input_ids"] == tokenizer.encode(TEXT).ids
    assert hf_tokenizer.eos_token == EOS_TOKEN
    assert loaded.config.eos_token_ids == (tokenizer.token_to_id(EOS_TOKEN),)
    for special in SPECIAL_TOKENS:
        assert tokenizer.encode(f"a{special}b").tokens == ["a", special, "b"]


def test_same_seed_writes_identical_files_and_another_seed_other_weights(tmp_path: Path) -> None:
    first, second, other = (
        make_model(tmp_path / name, seed=seed) for name, seed in [("a", 0), ("b", 0), ("c", 1)]
    )
    for name in ["model.safetensors", "config.json", "generation_config.json", "tokenizer.json"]:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_greedy_output_of_the_default_model_is_not_degenerate(tiny_dir: Path) -> None:
    loaded = load_model(tiny_dir)
    tokens = greedy(loaded.model, loaded.tokenizer.encode("The morning fog").ids, 32)
    assert len(set(tokens)) >= 8


def test_bench_small_has_the_benchmark_shape(tmp_path: Path) -> None:
    config = load_model(make_model(tmp_path, shape="bench-small")).config
    shape = (
        config.hidden_size,
        config.intermediate_size,
        config.num_layers,
        config.num_heads,
        config.num_kv_heads,
    )
    assert shape == (512, 1536, 8, 8, 4)
    assert (config.head_dim, config.vocab_size, config.tie_word_embeddings) == (64, 32000, True)


def test_unknown_shape_is_rejected_with_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny-random, bench-small"):
        make_model(tmp_path, shape="huge")


def test_the_tokenizer_trains_on_a_corpus_small_enough_for_every_test() -> None:
    # Every random checkpoint trains it (tests make dozens): its work is the corpus and the vocabulary.
    assert CORPUS_PATH.stat().st_size < 16 * 1024 and TOKENIZER_VOCAB_SIZE <= 1024
    assert train_tokenizer().get_vocab_size(with_added_tokens=True) == TOKENIZER_VOCAB_SIZE
