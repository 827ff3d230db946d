"""The soft-prompt embedder: a PEFT prompt-tuning adapter's virtual rows before the looked-up text.

A prompt-tuning adapter (`peft_type: PROMPT_TUNING`) trains `num_virtual_tokens` rows in the
decoder's input space while the model stays frozen; PEFT feeds them ahead of the token embeddings.
Prepending them here and sending the result as one embedding segment gives the decoder the same
input, with no adapter support in the decoder at all.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from tandem.encoder.embedder import (
    EmbedderInfo,
    EmbedderLoadError,
    Pooling,
    mean_pool,
    path_refusal,
    read_header,
    read_tensor,
)
from tandem.encoder.lookup import LookupEmbedder, read_json

PROMPT_KEY = "prompt_embeddings"


def check_prompt(adapter_dir: Path, hidden_size: int) -> None:
    """The adapter in `adapter_dir` is a prompt-tuning one for a model of `hidden_size`, and its
    prompt_embeddings are [num_virtual_tokens, token_dim] as its config states, judged from
    adapter_config.json and the safetensors header alone: the __main__ runs it before listening (a bad
    adapter was found by the load, after the server listened, exit 1). Raises EmbedderLoadError."""
    if (refusal := path_refusal(adapter_dir, is_dir=True)) is not None:
        raise EmbedderLoadError(f"adapter directory {refusal}")
    config = read_json(adapter_dir / "adapter_config.json")
    if config.get("peft_type") != "PROMPT_TUNING":
        raise EmbedderLoadError(
            f"adapter_config.json in {adapter_dir}: peft_type is {config.get('peft_type')!r}; "
            "only 'PROMPT_TUNING' adapters are supported"
        )
    num_virtual_tokens = config.get("num_virtual_tokens")
    token_dim = config.get("token_dim")
    for key, value in (("num_virtual_tokens", num_virtual_tokens), ("token_dim", token_dim)):
        if not isinstance(value, int) or value < 1:
            raise EmbedderLoadError(f"adapter_config.json: {key} must be a positive integer, got {value!r}")
    if token_dim != hidden_size:
        raise EmbedderLoadError(
            f"adapter_config.json: token_dim {token_dim} does not match the model's hidden_size "
            f"{hidden_size}; the adapter was trained for a different model"
        )
    stored, _ = read_header(adapter_dir / "adapter_model.safetensors", PROMPT_KEY)
    if stored != (num_virtual_tokens, token_dim):
        raise EmbedderLoadError(
            f"{PROMPT_KEY} has shape {list(stored)}, expected "
            f"[num_virtual_tokens, token_dim] = [{num_virtual_tokens}, {token_dim}]"
        )


def read_prompt(adapter_dir: Path, hidden_size: int) -> torch.Tensor:
    """The adapter's virtual rows, [num_virtual_tokens, hidden_size], checked against its config."""
    check_prompt(adapter_dir, hidden_size)  # again: the files may have changed since the start's check
    return read_tensor(adapter_dir / "adapter_model.safetensors", PROMPT_KEY)


class SoftPromptEmbedder:
    """Virtual rows, then the decoder's own embedding rows for the text."""

    def __init__(self, lookup: LookupEmbedder, prompt: torch.Tensor) -> None:
        self.lookup = lookup
        self.prompt = prompt.to(lookup.info.dtype)  # [num_virtual_tokens, hidden_size]
        self._info = EmbedderInfo(
            kind="soft-prompt",
            hidden_size=lookup.info.hidden_size,
            vocab_size=lookup.info.vocab_size,
            dtype=lookup.info.dtype,
            max_token_chars=lookup.info.max_token_chars,
            num_virtual_tokens=prompt.shape[0],
        )

    @classmethod
    def load(
        cls,
        model_dir: Path,
        adapter_dir: Path,
        dtype: torch.dtype,
        quantization: str = "none",
        tokenizer: Tokenizer | None = None,
    ) -> SoftPromptEmbedder:
        lookup = LookupEmbedder.load(model_dir, dtype, quantization, tokenizer)
        return cls(lookup, read_prompt(adapter_dir, lookup.info.hidden_size))

    @property
    def info(self) -> EmbedderInfo:
        return self._info

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.lookup.tokenize(text, add_special_tokens)

    def embed(self, token_ids: list[int], pooling: Pooling) -> torch.Tensor:
        # [num_virtual_tokens + num_tokens, hidden_size]
        rows = torch.cat((self.prompt, self.lookup.rows(token_ids)))
        return mean_pool(rows) if pooling is Pooling.MEAN else rows
