"""The bounded header walk that runs before the gguf package's reader: each hostile count, length or
offset is refused naming the field and the limit, within the file's size in time and memory."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from common.tests.common.gguf_files import small_model, write_gguf
from tandem.common.torch_part.gguf_header import GGUFHeaderError, check_header
from tandem.common.torch_part.gguf_import import GGUFImportError, import_gguf


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def string(text: str) -> bytes:
    return u64(len(text.encode())) + text.encode()


def gguf_file(fields: bytes = b"", num_fields: int = 0, tensors: bytes = b"", num_tensors: int = 0) -> bytes:
    """A version 3 GGUF file: the magic, the counts, the given fields and tensor infos, then 4 KiB."""
    return b"GGUF" + u32(3) + u64(num_tensors) + u64(num_fields) + fields + tensors + bytes(4096)


ARCH = string("general.architecture") + u32(8) + string("qwen3")
U8, STRING, ARRAY = 0, 8, 9


def tensor(name: str, dims: list[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    return string(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(ggml_type) + u64(offset)


HOSTILE = {
    # The gguf reader looped for ever on these two (a count of 2^62 empty reads), growing a list.
    "array of 2^62 bytes": (
        gguf_file(ARCH + string("x.a") + u32(ARRAY) + u32(U8) + u64(1 << 62), 2),
        r"truncated: 4,611,686,018,427,387,904 bytes of metadata x\.a's 4,611,686,018,427,387,904 values",
    ),
    "array of 2^62 strings": (
        gguf_file(ARCH + string("x.a") + u32(ARRAY) + u32(STRING) + u64(1 << 62), 2),
        r"truncated: 8 bytes of metadata x\.a's length",
    ),
    # RecursionError, a traceback, from the reader.
    "arrays nested 100,000 deep": (
        gguf_file(ARCH + string("x.a") + u32(ARRAY) + (u32(ARRAY) + u64(1)) * 100_000, 2),
        r"metadata x\.a nests arrays more than 4 deep",
    ),
    "key of 2^64 - 1 bytes": (
        b"GGUF" + u32(3) + u64(0) + u64(1) + u64((1 << 64) - 1) + bytes(64),
        r"truncated: 18,446,744,073,709,551,615 bytes of metadata key 0 from byte 32",
    ),
    "string value of 2^62 bytes": (
        gguf_file(string("general.architecture") + u32(STRING) + u64(1 << 62), 1),
        r"truncated: 4,611,686,018,427,387,904 bytes of metadata general\.architecture",
    ),
    "2^62 metadata fields": (
        b"GGUF" + u32(3) + u64(0) + u64(1 << 62) + ARCH,
        r"truncated: 8 bytes of metadata key 1's length",
    ),
    "2^62 tensors": (
        b"GGUF" + u32(3) + u64(1 << 62) + u64(1) + ARCH,
        r"truncated: 8 bytes of tensor 0's name's length",
    ),
    "unknown value type": (
        gguf_file(ARCH + string("x.y") + u32(77), 2),
        r"metadata x\.y has unknown type 77",
    ),
    "key twice": (gguf_file(ARCH + ARCH, 2), r"metadata general\.architecture appears twice"),
    "alignment 3": (
        gguf_file(ARCH + string("general.alignment") + u32(4) + u32(3), 2),
        r"general\.alignment must be a power of two, got 3",
    ),
    "version 99": (b"GGUF" + u32(99) + bytes(64), r"version 99 is not supported"),
    "unknown tensor type": (
        gguf_file(ARCH, 1, tensor("token_embd.weight", [64, 16], ggml_type=99), 1),
        r"tensor token_embd\.weight has unknown type 99",
    ),
    "2^31 dimensions": (
        gguf_file(ARCH, 1, string("t") + u32(1 << 31), 1),
        r"tensor t has 2147483648 dimensions, not 1 to 4",
    ),
    "dimensions whose product overflows 64 bits": (
        gguf_file(ARCH, 1, tensor("t", [1 << 32] * 4), 1),
        r"tensor t's dimensions \[4294967296, .*\] hold [\d,]+ values, not 1 to 2\^48",
    ),
    "data past the end": (
        gguf_file(ARCH, 1, tensor("t", [64, 16], offset=1 << 40), 1),
        r"truncated: tensor t ends at byte 1,099,511,\d{3},\d{3}, the file has",
    ),
    "misaligned offset": (
        gguf_file(ARCH, 1, tensor("t", [16], offset=3), 1),
        r"tensor t's offset 3 is not a multiple of 32",
    ),
    "one name twice": (
        gguf_file(ARCH, 1, tensor("t", [16]) + tensor("t", [16], offset=64), 2),
        r"tensor t appears twice",
    ),
    "overlapping data": (
        gguf_file(ARCH, 1, tensor("a", [64]) + tensor("b", [16], offset=32), 2),
        r"tensor b starts inside tensor a's data",
    ),
    "Q4_0 rows not whole blocks": (
        gguf_file(ARCH, 1, tensor("t", [48, 2], ggml_type=2), 1),
        r"tensor t's rows of 48 are not whole blocks of 32 \(Q4_0\)",
    ),
    "empty file": (b"", r"not a GGUF file \(0 bytes\)"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_header_is_refused_naming_the_field(tmp_path: Path, case: str) -> None:
    data, message = HOSTILE[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFHeaderError, match=message):
        check_header(path)


@pytest.mark.parametrize("case", ["array of 2^62 bytes", "arrays nested 100,000 deep", "overlapping data"])
def test_the_importer_refuses_them_as_one_line_naming_the_file(tmp_path: Path, case: str) -> None:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(HOSTILE[case][0])
    with pytest.raises(GGUFImportError, match=rf"^{path}: {HOSTILE[case][1]}"):
        import_gguf(path, tmp_path / "out")


def test_a_file_the_converter_wrote_passes_and_every_cut_of_it_is_truncated(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    path = write_gguf(tmp_path / "m.gguf", small_model("qwen3", tokenizer.get_vocab_size()), tokenizer)
    check_header(path)
    data = path.read_bytes()
    for cut in (10, 30, 2000, len(data) // 2, len(data) - 1):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(GGUFHeaderError, match="^truncated: "):
            check_header(tmp_path / "cut.gguf")
