"""A bounded walk over a GGUF file's header, run before the gguf package's reader sees the file.

The reader trusts every count and length it reads. An array of 2^62 u8 values past the end of the
file made it loop for ever (each element read as an empty slice that advances nothing, and kept in a
list that grows until memory runs out); arrays nested 200,000 deep overflowed its recursion. This walk
reads each count against the bytes left, so it ends within the file's size: every element it steps
over takes at least one byte, and a run of fixed-size values is stepped over at once. It checks what
llama.cpp's own loader checks of the tensor table too (known types, at most 4 dimensions, aligned
offsets, data inside the file, no two tensors sharing a name or a byte).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4  # arrays of arrays: no file in use nests them at all
MAX_ELEMENTS = 1 << 48  # one tensor's values; a product past this has overflowed somewhere
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType


class GGUFHeaderError(ValueError):
    """A header that cannot be read safely; the message names the field and the limit."""


def check_header(path: Path) -> None:
    """Raises GGUFHeaderError unless `path`'s header (metadata and tensor table) lies within the file and
    every tensor's data does too. Reads the header only."""
    with path.open("rb") as f:
        if path.stat().st_size < 8:  # mmap refuses an empty file
            raise GGUFHeaderError(f"not a GGUF file ({path.stat().st_size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _Walk(data).check()


class _Walk:
    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos, self.size = data, 0, len(data)
        self.order = "<"

    def take(self, num_bytes: int, what: str) -> int:
        """Steps over `num_bytes` bytes holding `what`; returns where they start."""
        if num_bytes > self.size - self.pos:
            raise GGUFHeaderError(
                f"truncated: {num_bytes:,} bytes of {what} from byte {self.pos:,}, "
                f"past the file's {self.size:,}"
            )
        start, self.pos = self.pos, self.pos + num_bytes
        return start

    def unpack(self, fmt: str, what: str) -> int:
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(self.order + fmt, self.data, start)[0]

    def string(self, what: str) -> str:
        length = self.unpack("Q", f"{what}'s length")
        start = self.take(length, what)
        try:
            return bytes(self.data[start : self.pos]).decode()
        except UnicodeDecodeError:
            raise GGUFHeaderError(f"{what} at byte {start:,} is not UTF-8") from None

    def check(self) -> None:
        if self.size < 8 or self.data[:4] != b"GGUF":
            raise GGUFHeaderError(f"not a GGUF file (magic {bytes(self.data[:4])!r}, expected b'GGUF')")
        self.pos = 4
        version = self.unpack("I", "version")
        if version & 0xFFFF == 0:  # written on a big-endian machine
            self.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFHeaderError(f"version {version} is not supported (supported: 2, 3)")
        num_tensors = self.unpack("Q", "tensor count")
        num_fields = self.unpack("Q", "metadata count")
        alignment = DEFAULT_ALIGNMENT
        keys: set[str] = set()
        for i in range(num_fields):  # each takes at least 12 bytes: a huge count ends at the file's end
            key = self.string(f"metadata key {i}")
            if key in keys:
                raise GGUFHeaderError(f"metadata {key} appears twice")
            keys.add(key)
            value_type = self.unpack("I", f"metadata {key}'s type")
            if key == "general.alignment":
                alignment = self.alignment(value_type)
            else:
                self.value(key, value_type, 0)
        tensors = [self.tensor_info(i) for i in range(num_tensors)]
        data_start = -(-self.pos // alignment) * alignment
        self.check_data(tensors, data_start, alignment)

    def alignment(self, value_type: int) -> int:
        if value_type != 4:
            raise GGUFHeaderError(f"metadata general.alignment must be a uint32, got type {value_type}")
        value = self.unpack("I", "general.alignment")
        if value == 0 or value & (value - 1):
            raise GGUFHeaderError(f"metadata general.alignment must be a power of two, got {value}")
        return value

    def value(self, key: str, value_type: int, depth: int) -> None:
        if value_type in _SCALAR_SIZES:
            self.take(_SCALAR_SIZES[value_type], f"metadata {key}")
        elif value_type == _STRING:
            self.take(self.unpack("Q", f"metadata {key}'s length"), f"metadata {key}")
        elif value_type == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFHeaderError(f"metadata {key} nests arrays more than {MAX_ARRAY_DEPTH} deep")
            item_type = self.unpack("I", f"metadata {key}'s item type")
            count = self.unpack("Q", f"metadata {key}'s length")
            if item_type in _SCALAR_SIZES:  # stepped over at once: a count past the file fails here
                self.take(count * _SCALAR_SIZES[item_type], f"metadata {key}'s {count:,} values")
            elif item_type in (_STRING, _ARRAY):
                for _ in range(count):  # each item takes at least 8 bytes
                    self.value(key, item_type, depth + 1)
            else:
                raise GGUFHeaderError(f"metadata {key} is an array of unknown type {item_type}")
        else:
            raise GGUFHeaderError(f"metadata {key} has unknown type {value_type}")

    def tensor_info(self, i: int) -> tuple[str, int, int]:
        """(name, offset from the data's start, bytes) of tensor `i`."""
        name = self.string(f"tensor {i}'s name")
        num_dims = self.unpack("I", f"tensor {name}'s dimension count")
        if not 1 <= num_dims <= MAX_DIMS:
            raise GGUFHeaderError(f"tensor {name} has {num_dims} dimensions, not 1 to {MAX_DIMS}")
        dims = [self.unpack("Q", f"tensor {name}'s dimensions") for _ in range(num_dims)]
        raw_type = self.unpack("I", f"tensor {name}'s type")
        offset = self.unpack("Q", f"tensor {name}'s offset")
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
        except (ValueError, KeyError):
            raise GGUFHeaderError(f"tensor {name} has unknown type {raw_type}") from None
        num_elements = 1
        for d in dims:
            num_elements *= d
        if not 1 <= num_elements <= MAX_ELEMENTS:
            raise GGUFHeaderError(
                f"tensor {name}'s dimensions {dims} hold {num_elements:,} values, not 1 to 2^48"
            )
        if dims[0] % block_size:
            raise GGUFHeaderError(
                f"tensor {name}'s rows of {dims[0]} are not whole blocks of {block_size} "
                f"({GGMLQuantizationType(raw_type).name})"
            )
        return name, offset, num_elements // block_size * type_size

    def check_data(self, tensors: list[tuple[str, int, int]], data_start: int, alignment: int) -> None:
        names: set[str] = set()
        end, previous = 0, ""
        for name, offset, num_bytes in sorted(tensors, key=lambda t: t[1]):
            if name in names:
                raise GGUFHeaderError(f"tensor {name} appears twice")
            names.add(name)
            if offset % alignment:
                raise GGUFHeaderError(f"tensor {name}'s offset {offset:,} is not a multiple of {alignment}")
            if offset < end:
                raise GGUFHeaderError(f"tensor {name} starts inside tensor {previous}'s data")
            end, previous = offset + num_bytes, name
            if data_start + end > self.size:
                raise GGUFHeaderError(
                    f"truncated: tensor {name} ends at byte {data_start + end:,}, the file has {self.size:,}"
                )
