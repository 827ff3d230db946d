"""The dtype table (`dtypes.py`) resolved to torch: the only place a dtype's name becomes a `torch.dtype`."""

from __future__ import annotations

import torch

from tandem.common.dtypes import COMPUTE_NAMES, DTYPES, FLOAT_NAMES, DType

# A dtype's name is torch's attribute name for it ("bfloat16" -> torch.bfloat16).
TORCH_DTYPES: dict[str, torch.dtype] = {d.name: getattr(torch, d.name) for d in DTYPES}
BY_TORCH: dict[torch.dtype, DType] = {TORCH_DTYPES[d.name]: d for d in DTYPES}
# The compute dtypes by the name their `--dtype` flags and configs use.
COMPUTE_DTYPES: dict[str, torch.dtype] = {name: TORCH_DTYPES[name] for name in COMPUTE_NAMES}
# What an embeddings tensor may be on the wire.
FLOAT_TORCH_DTYPES: frozenset[torch.dtype] = frozenset(TORCH_DTYPES[name] for name in FLOAT_NAMES)
