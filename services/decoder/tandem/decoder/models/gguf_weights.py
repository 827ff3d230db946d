"""A GGUF file's own quantized weights, for `--quantization gguf`: every linear and the token table.

The checkpoint directory imported from the file (common/torch_part/gguf_import.py) gives the model its config,
tokenizer, norms and dense weights; this reads the file's linear weights again, as stored:
- Q4_0 (d (q - 8)), Q4_1 (d q + m) and Q8_0 (d q) blocks are served as they are (models/quantized.py's
  form: the same codes and fp16 scales, every value computed as GGUF computes it);
- any other type is dequantized by the gguf package and re-quantized once, to 4 bits for the types
  of 4 bits or fewer (Q2_K .. Q4_K, IQ*) and to 8 bits for the rest (Q5_*, Q6_K, F16, F32, BF16),
  which the log says.
Llama files store the Q and K rows in llama.cpp's RoPE order; they are put back, codes and scales
alike (a permutation of output rows moves whole blocks).
The tensors fused into one projection (q, k, v; gate, up) may be stored in different types (a Q4_K_M
file keeps attn_v in Q6_K beside Q4_K q and k): they are then held in one form (`_one_form`), exactly
where it exists (Q4_0's d (q - 8) is Q8_0's d q with codes q - 8, and Q4_1's d q + m with m = -8 d), and
as 8 bits, rounded once per block of 32 from the file's values, for a Q4_1 tensor, or one re-quantized
to 4 bits, beside 8-bit ones.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.common.torch_part.gguf_header import check_header
from tandem.common.torch_part.gguf_import import gguf_name, readable_types, unpermute_rows
from tandem.common.torch_part.quantized_tensor import BLOCK, QuantizedTensor, cat_rows, pack, quantize
from tandem.decoder.models.quantized import quantizable
from tandem.decoder.models.quantized_shards import cut

log = logging.getLogger(__name__)

SERVED = ("Q4_0", "Q4_1", "Q8_0")  # served as stored
_TO_4_BITS = ("Q2_K", "Q3_K", "Q4_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
              "IQ4_NL", "IQ4_XS")  # fmt: skip


class QuantizationError(ValueError):
    """Weights that cannot be served quantized; the message is one line naming the flag and why."""


def read_quantized(gguf_path: Path, model: torch.nn.Module) -> dict[str, QuantizedTensor]:
    """The quantized form of every linear weight and of the token table of `model` (parameter name ->
    weight), from the GGUF file it was imported from; with several ranks, this rank's cut of each."""
    import gguf

    try:
        check_header(gguf_path)  # bounds every length before the reader trusts it
        reader = gguf.GGUFReader(str(gguf_path))
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:  # GGUFHeaderError is a ValueError
        raise QuantizationError(f"--quantization gguf: {gguf_path} cannot be read: {e}") from None
    tensors = {t.name: t for t in reader.tensors}
    field = reader.fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    heads = {"num_attention_heads": model.config.num_heads, "num_key_value_heads": model.config.num_kv_heads}
    tp = model.tp  # several ranks: each part read whole, then cut (quantized_shards.py)
    out: dict[str, QuantizedTensor] = {}
    requantized: Counter[str] = Counter()
    for param in quantizable(model):
        checkpoint_parts = model.checkpoint_parts(param)
        keys = [gguf_name(part.name) for part in checkpoint_parts]
        for part, key in zip(checkpoint_parts, keys, strict=True):
            if key is None or key not in tensors:
                raise QuantizationError(f"--quantization gguf: {gguf_path} has no tensor for {part.name}")
        # A re-quantized part fused beside 8-bit ones is rounded once, to 8 bits (_one_form).
        types = {tensors[key].tensor_type.name for key in keys}
        eight_bits = len(types) > 1 and any(t not in ("Q4_0", "Q4_1", *_TO_4_BITS) for t in types)
        parts = []
        for part, key in zip(checkpoint_parts, keys, strict=True):
            whole = _read(tensors[key], part.name, architecture, heads, requantized, eight_bits)
            parts.append(whole if tp is None else cut(whole, part.shard_dim, tp.rank, tp.world_size))
        out[param] = parts[0] if len(parts) == 1 else cat_rows(_one_form(parts, param, requantized))
    if requantized:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(requantized.items()))
        log.info("--quantization gguf: re-quantized once (not a type served as stored): %s", kinds)
    return out


def _read(
    tensor: Any,
    hf_name: str,
    architecture: str,
    heads: dict[str, int],
    requantized: Counter[str],
    eight_bits: bool = False,
) -> QuantizedTensor:
    """One GGUF tensor as a QuantizedTensor in Hugging Face's row order; a type not served as stored
    re-quantized to 8 bits with `eight_bits`, else as its own bits say."""
    import gguf

    kind = tensor.tensor_type.name
    n, k = (int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions fastest-first
    if kind in SERVED:
        codes, d, m = _blocks(np.asarray(tensor.data), kind, n, k)
        if architecture == "llama":
            codes, d = unpermute_rows(hf_name, codes, heads), unpermute_rows(hf_name, d, heads)
            m = None if m is None else unpermute_rows(hf_name, m, heads)
        return pack(
            torch.from_numpy(np.ascontiguousarray(codes)),
            torch.from_numpy(np.ascontiguousarray(d)),
            None if m is None else torch.from_numpy(np.ascontiguousarray(m)),
        )
    try:
        dense = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        dense = np.array(dense, dtype=np.float32).reshape(n, k)
    except NotImplementedError as e:
        raise QuantizationError(  # the import refuses the file first; this, a file given to load_model
            f"--quantization gguf: {tensor.name} ({hf_name}) is of GGML type {kind}, which the gguf package "
            f"cannot dequantize (readable: {', '.join(readable_types())})"
        ) from e
    if k % BLOCK != 0:
        raise QuantizationError(
            f"--quantization gguf: {hf_name} has rows of {k}, not a whole number of blocks of {BLOCK}"
        )
    if architecture == "llama":
        dense = unpermute_rows(hf_name, dense, heads)
    requantized[kind] += 1
    bits = 4 if kind in _TO_4_BITS and not eight_bits else 8
    return quantize(torch.from_numpy(np.ascontiguousarray(dense)), bits)


def _one_form(parts: list[QuantizedTensor], param: str, requantized: Counter[str]) -> list[QuantizedTensor]:
    """The parts of one fused projection in the form all of them can take, which cat_rows needs: 8 bits
    beside any 8-bit part, else 4 bits with offsets beside any part that has them."""
    if len({(p.bits, p.mins is None) for p in parts}) == 1:
        return parts
    if all(p.bits == 4 for p in parts):
        with_offsets = [p if p.mins is not None else _with_offsets(p) for p in parts]
        if all(p is not None for p in with_offsets):
            return [p for p in with_offsets if p is not None]
    held = []
    for p in parts:
        if p.bits == 4 and p.mins is not None:  # 8 bits have no offset: the values rounded to 8 bits
            requantized[f"4-bit with offsets beside other types in {param}"] += 1
            p = quantize(p.dequantize(torch.float32), 8)
        elif p.bits == 4:
            codes, d, _ = p.unpack()
            p = pack((codes.to(torch.int16) - 8).to(torch.int8), d)
        held.append(p)
    return held


def _with_offsets(part: QuantizedTensor) -> QuantizedTensor | None:
    """A Q4_0 weight (d (q - 8)) as 4 bits with offsets (d q + m, m = -8 d: exact in fp16); None where
    an offset would pass fp16's range."""
    codes, d, _ = part.unpack()
    m = d * -8
    if bool((torch.isinf(m) & torch.isfinite(d)).any()):
        return None
    return pack(codes, d, m)


def _blocks(data: np.ndarray, kind: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """codes [n, k], d and m [n, k / 32] (m only for Q4_1) of a Q4_0, Q4_1 or Q8_0 tensor's raw bytes.
    A scale that is not finite stays so: the weights it scales are then what the file says, NaN."""
    nb = k // BLOCK
    raw = data.reshape(n, nb, -1)  # [rows, blocks, bytes per block]
    d = raw[:, :, 0:2].copy().view(np.float16).reshape(n, nb)
    if kind == "Q8_0":
        return raw[:, :, 2:34].copy().view(np.int8).reshape(n, k), d, None
    qs = raw[:, :, 4:20] if kind == "Q4_1" else raw[:, :, 2:18]  # 16 bytes: code j low, code j + 16 high
    codes = np.concatenate((qs & 15, qs >> 4), axis=-1).reshape(n, k).astype(np.uint8)
    m = raw[:, :, 2:4].copy().view(np.float16).reshape(n, nb) if kind == "Q4_1" else None  # Q4_0: d (q - 8)
    return codes, d, m
