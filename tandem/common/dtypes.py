"""The compute dtypes the services run in, by the name their `--dtype` flags and configs use."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
