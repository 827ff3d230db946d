"""A checkpoint imported from a GGUF file (tandem import-gguf, in tandem.common) served by the decoder:
the same greedy tokens as the model that wrote the file, and as transformers reading that file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from common.tests.common.gguf_files import WRITABLE_TYPES, Q, small_model, write_gguf
from tandem.common.torch_part.gguf_import import import_gguf
from tandem.decoder.models.loader import load_model

from .helpers import greedy


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_imported_checkpoint_generates_what_the_original_model_generates(
    arch: str, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    model = small_model(arch, tokenizer.get_vocab_size())
    out = import_gguf(
        write_gguf(tmp_path / "model.gguf", model, tokenizer), tmp_path / "out", dtype="float32"
    )
    loaded = load_model(out, dtype="float32")
    prompt = [5, 17, 300, 42, 9, 128]
    reference = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12)
    assert greedy(loaded.model, prompt, 12) == reference[0, len(prompt) :].tolist()


@pytest.mark.parametrize("qtype", WRITABLE_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_each_quantization_type_matches_transformers_reading_the_same_file(
    arch: str, qtype: Q, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    path = write_gguf(tmp_path / "m.gguf", small_model(arch, tokenizer.get_vocab_size()), tokenizer, qtype)
    ours = load_model(import_gguf(path, tmp_path / "out", dtype="float32"), dtype="float32")
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    state = theirs.state_dict()
    for name, tensor in load_file(tmp_path / "out" / "model.safetensors").items():
        torch.testing.assert_close(tensor, state[name], atol=0, rtol=0, msg=name)
    prompt = [3, 44, 210, 7]
    reference = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8)
    assert greedy(ours.model, prompt, 8) == reference[0, len(prompt) :].tolist()
