"""The projector embedder: a Hugging Face encoder model plus a projector into the decoder's space.

The pattern of LLaVA-style multimodal models: a separate encoder (here a BERT-family text model)
produces hidden states, and a small projector, trained for one decoder, maps each of them to a row
in that decoder's input space. The projector file is safetensors in one of two layouts:

- a single Linear: `weight` [out, in], `bias` [out];
- LLaVA's `mm_projector` (mlp2x_gelu): Linear, GELU, Linear with keys `0.weight`, `0.bias`,
  `2.weight`, `2.bias`, optionally prefixed `model.mm_projector.` as in a full LLaVA checkpoint.

Mean pooling averages the encoder's hidden states before projecting (sentence-transformers' sentence
embedding, then mapped into the decoder's space), rather than averaging projected rows. transformers
is imported only when this embedder is loaded: the other embedders do not need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tandem.common import text_bounds
from tandem.encoder.embedder import EmbedderInfo, EmbedderLoadError, Pooling, mean_pool, path_refusal
from tandem.encoder.lookup import read_json, read_model_shape

LLAVA_PREFIX = "model.mm_projector."
LINEAR_KEYS = frozenset({"weight", "bias"})
MLP_KEYS = frozenset({"0.weight", "0.bias", "2.weight", "2.bias"})


def projector_widths(path: Path) -> tuple[int, int]:
    """(in_features, out_features) of the projector in `path`, from its safetensors header alone: its
    keys are one of the two layouts and their shapes agree. Raises EmbedderLoadError naming the file."""
    if (refusal := path_refusal(path, is_dir=False)) is not None:
        raise EmbedderLoadError(f"projector file {refusal}")
    try:
        with safe_open(path, framework="pt", device="cpu") as weights:
            shapes = _unprefixed({key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()})
    except (SafetensorError, OSError) as e:  # SafetensorError is a bare Exception
        raise EmbedderLoadError(f"{path} is not a readable safetensors file: {e}") from None
    keys = frozenset(shapes)
    for key in sorted(keys):
        if key.endswith("weight") and len(shapes[key]) != 2:
            raise EmbedderLoadError(f"{path}: {key} has shape {list(shapes[key])}; expected a matrix")
    if keys == LINEAR_KEYS:
        first, last = shapes["weight"], shapes["weight"]
        expected = {"weight": (first[0], first[1]), "bias": (first[0],)}
    elif keys == MLP_KEYS:
        first, last = shapes["0.weight"], shapes["2.weight"]
        out_features = first[0]
        expected = {
            "0.weight": (out_features, first[1]),
            "0.bias": (out_features,),
            "2.weight": (out_features, out_features),
            "2.bias": (out_features,),
        }
    else:
        raise EmbedderLoadError(
            f"{path}: unrecognised projector keys {sorted(keys)}; expected {sorted(LINEAR_KEYS)} (Linear) "
            f"or {sorted(MLP_KEYS)} (LLaVA mlp2x_gelu, optionally prefixed {LLAVA_PREFIX!r})"
        )
    for key, shape in expected.items():
        if shapes[key] != shape:
            raise EmbedderLoadError(f"{path}: {key} has shape {list(shapes[key])}, expected {list(shape)}")
    return first[1], last[0]


def _unprefixed(named: dict[str, Any]) -> dict[str, Any]:
    """A full LLaVA checkpoint's names, as the projector's own (every name prefixed, or none taken)."""
    if named and all(key.startswith(LLAVA_PREFIX) for key in named):
        return {key.removeprefix(LLAVA_PREFIX): value for key, value in named.items()}
    return named


def load_projector(path: Path) -> nn.Module:
    """The projector in `path`: nn.Linear or nn.Sequential(Linear, GELU, Linear), in eval mode."""
    in_features, out_features = projector_widths(path)
    with safe_open(path, framework="pt", device="cpu") as weights:
        state = _unprefixed({key: weights.get_tensor(key) for key in weights.keys()})
    with torch.device("meta"):
        if frozenset(state) == LINEAR_KEYS:
            projector: nn.Module = nn.Linear(in_features, out_features)
        else:
            # LLaVA's GELU is the exact (erf) one, nn.GELU's default.
            projector = nn.Sequential(
                nn.Linear(in_features, out_features), nn.GELU(), nn.Linear(out_features, out_features)
            )
    projector.load_state_dict(state, assign=True)
    return projector.train(False).requires_grad_(False)  # inference mode


def encoder_hidden_size(encoder_model_dir: Path) -> int | None:
    """hidden_size from the encoder model's config.json, which transformers needs: a directory without
    one was refused by transformers with advice to install sentencepiece (the tokenizer, looked up
    first, fell back to a slow one). None where config.json names it otherwise (DistilBERT's `dim`),
    for transformers to map. Raises EmbedderLoadError naming the directory or the file."""
    if (refusal := path_refusal(encoder_model_dir, is_dir=True)) is not None:
        raise EmbedderLoadError(f"encoder model directory {refusal}")
    hidden_size = read_json(encoder_model_dir / "config.json").get("hidden_size")
    return hidden_size if isinstance(hidden_size, int) else None


def check_projector(path: Path, encoder_hidden: int | None, decoder_hidden: int, model_dir: Path) -> None:
    """The projector in `path` maps the encoder's `encoder_hidden` (None: not known yet) to the
    decoder's `decoder_hidden` (`model_dir`'s), judged from its header alone: the __main__ runs it
    before listening. Raises EmbedderLoadError naming the file."""
    in_features, out_features = projector_widths(path)
    if encoder_hidden is not None and in_features != encoder_hidden:
        raise EmbedderLoadError(
            f"{path}: projector input width {in_features} does not match the encoder's hidden_size "
            f"{encoder_hidden}"
        )
    if out_features != decoder_hidden:
        raise EmbedderLoadError(
            f"{path}: projector output width {out_features} does not match the decoder's hidden_size "
            f"{decoder_hidden} (config.json in {model_dir})"
        )


def _linears(projector: nn.Module) -> list[nn.Linear]:
    return [m for m in projector.modules() if isinstance(m, nn.Linear)]


class ProjectorEmbedder:
    """Encoder hidden states -> projector -> rows of the decoder's width."""

    def __init__(self, encoder: Any, tokenizer: Any, projector: nn.Module, dtype: torch.dtype) -> None:
        self.encoder = encoder  # a transformers PreTrainedModel (BERT family), eval mode
        self.tokenizer = tokenizer  # its transformers tokenizer
        self.projector = projector  # [*, encoder hidden] -> [*, decoder hidden]
        config = encoder.config
        self._info = EmbedderInfo(
            kind="projector",
            hidden_size=_linears(projector)[-1].out_features,
            vocab_size=config.vocab_size,
            dtype=dtype,
            max_token_chars=_max_token_chars(tokenizer),
            max_positions=getattr(config, "max_position_embeddings", None),
        )

    @classmethod
    def load(
        cls, model_dir: Path, encoder_model_dir: Path, projector_path: Path, dtype: torch.dtype
    ) -> ProjectorEmbedder:
        decoder_hidden = read_model_shape(model_dir).hidden_size
        encoder_hidden_size(encoder_model_dir)  # its config.json, before transformers looks for more
        try:
            from transformers import AutoModel, AutoTokenizer
        except ImportError as e:
            raise EmbedderLoadError(
                "the projector embedder needs transformers (pip install 'transformers>=4.51', or this "
                f"checkout's extra: pip install -e '.[projector]'): {e}"
            ) from e

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(encoder_model_dir), local_files_only=True)
            encoder = AutoModel.from_pretrained(str(encoder_model_dir), local_files_only=True)
        except (OSError, ValueError) as e:
            raise EmbedderLoadError(f"cannot load the encoder model in {encoder_model_dir}: {e}") from e
        encoder = encoder.to(dtype).train(False).requires_grad_(False)
        check_projector(projector_path, encoder.config.hidden_size, decoder_hidden, model_dir)
        projector = load_projector(projector_path).to(dtype)
        return cls(encoder, tokenizer, projector, dtype)

    @property
    def info(self) -> EmbedderInfo:
        return self._info

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    @torch.inference_mode()
    def encode(self, token_ids: list[int]) -> torch.Tensor:
        """The encoder's last hidden states: [len(token_ids), encoder hidden_size]."""
        input_ids = torch.tensor([token_ids], dtype=torch.long)  # [1, num_tokens]
        output = self.encoder(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
        return output.last_hidden_state[0]

    @torch.inference_mode()
    def embed(self, token_ids: list[int], pooling: Pooling) -> torch.Tensor:
        hidden = self.encode(token_ids)  # [num_tokens, encoder hidden_size]
        if pooling is Pooling.MEAN:
            hidden = mean_pool(hidden)  # [1, encoder hidden_size]
        return self.projector(hidden)  # [num_rows, decoder hidden_size]


def _max_token_chars(tokenizer: Any) -> int:
    """A transformers tokenizer's bound: its Rust tokenizer's when it is a fast one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return text_bounds.max_token_chars(backend)
    return text_bounds.vocabulary_bound(tokenizer.get_vocab(), is_byte_level=False)
