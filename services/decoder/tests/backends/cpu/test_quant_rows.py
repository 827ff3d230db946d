"""A quantized token table's rows (csrc/quant_rows.c): the bits of QuantizedTensor.rows, the reference.

Each value is GGUF's fp32 value (d q + m, d (q - 8), d q) rounded once to the output dtype, on every
build, for any ids in any order (repeats, the table's first and last rows, a partial last group);
ids outside the table are refused before anything is written. A quantized model on the CPU executor
looks its tokens up through it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.decoder.tests.backends.cpu.test_linear_quant import KINDS
from tandem.common.torch_part.quantized_tensor import pack
from tandem.decoder.backends.cpu.executor import CpuExecutor
from tandem.decoder.backends.cpu.kernels import Kernels
from tandem.decoder.models.loader import load_model
from tandem.decoder.models.quantized import QuantizedEmbedding


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", list(KINDS))
def test_rows_are_the_references_bits(kernels: Kernels, kind: str, dtype: torch.dtype) -> None:
    n, k = 1000, 96  # 63 groups of 16 outputs, the last one partial (8 rows)
    table = KINDS[kind](n, k, seed=4)
    weight = kernels.quantized_weight(table)
    for ids in (
        torch.tensor([0]),
        torch.tensor([n - 1, 0, 17, 17, 999, 992]),  # any order, repeats, the partial group
        torch.randint(0, n, (33,), generator=torch.Generator().manual_seed(1)),
        torch.randint(0, n, (3000,), generator=torch.Generator().manual_seed(2)),  # a prefill: the team
    ):
        assert same_bits(kernels.quantized_rows(weight, ids, dtype), table.rows(ids, dtype)), ids[:8]
    assert kernels.quantized_rows(weight, torch.tensor([], dtype=torch.int64), dtype).shape == (0, k)


def test_extreme_scales_round_as_the_reference(kernels: Kernels) -> None:
    # fp16's largest scale and offset (values near 1e6, far from fp32's rounding) and a subnormal
    # scale (exact in fp32, its products below bf16's normal range): the same bits.
    codes = torch.randint(0, 16, (32, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    d = torch.tensor([[65504.0, 6e-8]] * 32).half()  # fp16's largest normal, a subnormal
    m = torch.tensor([[-65504.0, 0.0]] * 32).half()
    table = pack(codes, d, m)
    ids = torch.arange(32)
    got = kernels.quantized_rows(kernels.quantized_weight(table), ids, torch.bfloat16)
    assert same_bits(got, table.rows(ids, torch.bfloat16))


def test_ids_outside_the_table_are_refused_naming_the_range(kernels: Kernels) -> None:
    table = KINDS["q4_1"](40, 64)
    weight = kernels.quantized_weight(table)
    for bad in ([40], [0, -1], [3, 2**40]):
        with pytest.raises(ValueError, match=r"ids must be in \[0, 40\)"):
            kernels.quantized_rows(weight, torch.tensor(bad), torch.bfloat16)
    with pytest.raises(ValueError, match="ids must be torch.int64"):
        kernels.quantized_rows(weight, torch.tensor([1], dtype=torch.int32), torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        kernels.quantized_rows(weight, torch.tensor([1]), torch.float16)
    with pytest.raises(ValueError, match="needs a quantized weight"):
        kernels.quantized_rows(
            kernels.pack_weight(torch.zeros(16, 32, dtype=torch.bfloat16)), torch.tensor([1]), torch.bfloat16
        )


def test_a_quantized_model_on_the_cpu_executor_looks_tokens_up_in_c(
    kernels: Kernels, tiny_model_dir: Path
) -> None:
    model = load_model(tiny_model_dir, dtype="bfloat16", quantization="int4", group_size=64).model
    table = model.embed_tokens
    assert isinstance(table, QuantizedEmbedding)
    ids = torch.tensor([[5, 0, 7], [7, 1, 2]])
    reference = table(ids)  # QuantizedTensor.rows until an executor binds the kernel
    CpuExecutor(model, kernels)
    looked_up = table(ids)
    assert looked_up.shape == (2, 3, table.embedding_dim)
    assert same_bits(looked_up, reference)
    with pytest.raises(ValueError, match=r"ids must be in \[0, "):  # the kernel answers now
        table(torch.tensor([table.num_embeddings]))
