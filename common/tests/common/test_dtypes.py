"""The one dtype table, checked against its references: the proto's DataType enum and torch's dtypes."""

from __future__ import annotations

import torch

from tandem.client.pb.tandem.v1 import tensor_pb2
from tandem.common import dtypes
from tandem.common.torch_part.torch_dtypes import BY_TORCH, COMPUTE_DTYPES, FLOAT_TORCH_DTYPES, TORCH_DTYPES


def test_every_wire_dtype_of_the_proto_is_in_the_table_under_its_enum_name() -> None:
    declared = {code for code in tensor_pb2.DataType.values() if code != tensor_pb2.DATA_TYPE_UNSPECIFIED}
    assert set(dtypes.BY_WIRE) == declared
    for d in dtypes.DTYPES:
        assert tensor_pb2.DataType.Name(d.wire) == f"DATA_TYPE_{d.name.upper()}"
    assert [d.wire for d in dtypes.DTYPES] == sorted(declared)  # listed in the enum's order


def test_sizes_and_float_kinds_are_torchs() -> None:
    for d in dtypes.DTYPES:
        torch_dtype = TORCH_DTYPES[d.name]
        assert (d.itemsize, d.is_float) == (torch_dtype.itemsize, torch_dtype.is_floating_point), d
        assert BY_TORCH[torch_dtype] is d
    assert FLOAT_TORCH_DTYPES == {torch.float32, torch.float16, torch.bfloat16}


def test_the_derived_lists_are_subsets_of_the_table_by_name() -> None:
    assert dtypes.FLOAT_NAMES == ("float32", "float16", "bfloat16")  # what a JSON body's dtype may be
    assert dtypes.COMPUTE_NAMES == ("bfloat16", "float16", "float32")  # every --dtype flag's choices
    assert dtypes.FLOAT_DATA_TYPES == {dtypes.BY_NAME[n].wire for n in dtypes.FLOAT_NAMES}
    assert COMPUTE_DTYPES == {name: getattr(torch, name) for name in dtypes.COMPUTE_NAMES}
