"""The C kernels of one ISA level, loaded with ctypes, each behind a typed wrapper that checks its tensors.

The libraries are built when the project is installed (`build.py`, run by setup.py), one per ISA
level; `load_for_cpu()` loads the highest level this CPU runs and says which in one log line, or says
why there is none (not built, built from other sources, cannot be loaded) and returns None: the
executor then runs the model on torch ops. Nothing is compiled when a service starts.

Tensors are passed as data pointers, after the wrapper has checked their device, dtype, shape and
contiguity (ValueError naming the argument otherwise): the C side cannot see a buffer's size, so it
trusts those, and checks the slots, block ids and lengths itself.

Every wrapper is also a torch custom op, `torch.ops.tandem_<level>.<name>`, with a fake (meta)
implementation, so a traced or compiled graph can hold the call (`ops.py`).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import math
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch

from tandem.common.torch_part import huge_pages
from tandem.common.torch_part.quantized_tensor import QuantizedTensor
from tandem.decoder.backends.cpu.build import Level, build_id, module_name
from tandem.decoder.backends.cpu.isa import CpuInfo, best_level, this_cpu
from tandem.decoder.backends.cpu.limits import Limits, fits

log = logging.getLogger(__name__)

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class KernelsUnavailable(RuntimeError):
    """This level's library is not there, is not the build of these sources, or cannot be loaded."""


class Kernels:
    """The loaded library, with one typed wrapper per kernel.

    The C side reads and writes through raw pointers and can check only the indices it is given (slots,
    block ids, lengths): every wrapper checks each tensor's device, dtype, shape and contiguity before
    the call, and raises ValueError naming the argument. Whether a kernel fits a model at all is the
    executor's question, answered once at bind time by `limits.fits` against this build's `limits`.
    """

    def __init__(self, library: ctypes.CDLL, level: Level, path: Path) -> None:
        self.level = level
        self.path = path
        self.limits = Limits.read(library)  # csrc/limits.h, as this build exports it
        pointers, sizes = [ctypes.c_void_p], [ctypes.c_int64]
        self._decode_attention = _bind(
            library.tandem_decode_attention, pointers * 5 + sizes * 7 + [ctypes.c_float, ctypes.c_int]
        )
        self._rms_norm = _bind(
            library.tandem_rms_norm, pointers * 3 + sizes * 2 + [ctypes.c_float, ctypes.c_int]
        )
        self._qkv_rope_cache = _bind(
            library.tandem_qkv_rope_cache, pointers * 9 + sizes * 5 + [ctypes.c_float, ctypes.c_int]
        )
        # The raw bf16 linear (linear.c); call it through linear.CLinear, which checks every tensor
        # it hands over. Its weights are in weight_layout: 0 = [n, k] as stored, 16 = packed for
        # AVX512-BF16 (linear_packed.c), made once per weight by pack_weight.
        self.linear_bf16 = _bind(library.tandem_linear_bf16, pointers * 4 + sizes * 3)
        # Any weight (weight.h's descriptor: bf16, float32, or quantized_weight's); call it through
        # linear.CLinear or linear.QuantLinear, which check every tensor they hand over.
        self.linear = _bind(library.tandem_linear, pointers * 4 + sizes * 3 + [ctypes.c_int])
        self.weight_layout = int(_bind(library.tandem_weight_layout, [])())
        # Whether decode_attention runs bf16 caches with head_dim a multiple of limits.tiled_head_dim
        # (at most limits.max_head_dim) through the tiled kernel (attention_tiles.c), fast at any
        # context length.
        self.tiled_attention = bool(_bind(library.tandem_attention_tiles_available, [])())
        # Whether packed bf16 weights, and int8 activations, may run on AMX tiles (csrc/linear_tiles.c,
        # linear_int8.c): the amx build, on a CPU whose kernel granted this process the tile state
        # (asked here, once).
        self.tiles = bool(_bind(library.tandem_tiles_available, [])())
        if level.name == "amx" and not self.tiles:
            # Linux refuses the tile state to a process with a sigaltstack too small for its signal
            # frame, or a kernel built without it: every call then stays on the vector kernels.
            log.warning("CPU kernels: the kernel refused this process the AMX tile state (arch_prctl "
                        "ARCH_REQ_XCOMP_PERM): the amx build runs VDPBF16PS and VPDPBUSD only")  # fmt: skip
        self._pack_bf16 = _bind(library.tandem_pack_bf16, pointers * 2 + sizes * 2)
        # Packed weights side by side in huge pages, in the order a model binds them (its layers'):
        # a step of one sequence streams them at memory speed, and 4 KiB pages cost it 3-5 % (SmolLM2
        # bf16 linears at one row, 10.8 against 11.1 ms a step, Zen 4, one process, interleaved).
        self._weights = huge_pages.Arena()
        self._packed_elements = library.tandem_packed_elements
        self._packed_elements.restype, self._packed_elements.argtypes = ctypes.c_int64, sizes * 2
        self._argmax_f32 = _bind(library.tandem_argmax_f32, pointers + sizes * 2 + pointers)
        self._quantized_rows = _bind(
            library.tandem_quantized_rows, pointers * 2 + sizes + pointers + [ctypes.c_int]
        )
        # The raw copy of a shared-memory segment fused with its digest's GHASH (copy_digest.c); call
        # it through copy_digest.FusedCopyDigest, which checks the buffers and computes the AES blocks.
        self.copy_ghash = _bind(
            library.tandem_copy_ghash, pointers * 2 + sizes + pointers * 3 + [ctypes.c_int]
        )
        # The raw fused layer halves (layer_kernels.c); call them through layer.FusedLayer.
        real = [ctypes.c_float]
        self.attention_in = _bind(
            library.tandem_attention_in,
            pointers * 2 + real + pointers * 4 + real + pointers * 4 + sizes + pointers * 3 + sizes * 5,
        )
        self.mlp_block = _bind(library.tandem_mlp_block, pointers * 5 + real + pointers * 4 + sizes * 4)
        # Every layer of a decode-only step (layer_kernels.c); call it through stack.DecodeStack.
        self.decode_layers = _bind(
            library.tandem_decode_layers,
            pointers * 3 + sizes + real + pointers * 5 + sizes * 3 + real + pointers * 2 + sizes * 6,
        )

    def pack_weight(
        self, weight: torch.Tensor, layout: int | None = None, tile_rows: int = 0
    ) -> KernelWeight:
        """A linear's weight [n, k] bf16 as this build's linear reads it (`layout`, default
        weight_layout): the weight itself for 0, else a packed copy (1-D, n and k padded). Calls of
        `tile_rows` rows on (0: never) run on AMX tiles, which only a build with `tiles` has."""
        _check_tensor("weight", weight, torch.bfloat16)
        if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] < 1:
            raise ValueError(f"weight must be [n, k] with n, k >= 1, got {_shape(weight)}")
        _check_count("tile_rows", tile_rows, low=0)
        if tile_rows and not self.tiles:
            raise ValueError(f"tile_rows needs AMX tiles, which the {self.level.name} build here has not")
        n, k = weight.shape
        if (self.weight_layout if layout is None else layout) == 0:
            if tile_rows:
                raise ValueError("tile_rows needs the packed layout (the tiles read it)")
            return KernelWeight(WEIGHT_BF16, n, k, weight)
        packed = self._weights.empty(self._packed_elements(n, k), torch.bfloat16)
        _check(self._pack_bf16(weight.data_ptr(), packed.data_ptr(), n, k), f"pack_weight: [{n}, {k}]")
        return KernelWeight(WEIGHT_BF16, n, k, packed, tile_rows=tile_rows)

    def float_weight(self, weight: torch.Tensor) -> KernelWeight:
        """A linear's weight [n, k] float32 as csrc/linear_f32.c reads it: the weight itself, in place
        (the kernel reads it as nn.Linear stores it)."""
        _check_tensor("weight", weight, torch.float32)
        if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] < 1:
            raise ValueError(f"weight must be [n, k] with n, k >= 1, got {_shape(weight)}")
        return KernelWeight(WEIGHT_F32, weight.shape[0], weight.shape[1], weight)

    def quantized_weight(
        self,
        weight: QuantizedTensor,
        dense_rows: int = 0,
        int8_activations: bool = False,
        tile_rows: int = 0,
    ) -> KernelWeight:
        """A quantized weight as the kernels read it: its own tensors, in place (models/quantized.py's
        layout is the one csrc/linear_quant.c reads). From `dense_rows` rows on (0: never), a bf16 call
        runs each weight as its bf16 rounding, dequantized tile by tile into the packed bf16 kernel:
        the dense checkpoint's speed and bits for a prefill, where the exact per-block sums cost 1.3x.
        With `int8_activations` (--quantized-activations int8) every call instead rounds each row's
        inputs to int8 per block of 32 and multiplies them as integers (csrc/linear_int8.c): lossy,
        faster than either at any row count; calls of `tile_rows` rows on (0: never) do those integer
        sums on AMX-INT8 tiles (the same bits), which only a build with `tiles` has."""
        _check_count("tile_rows", tile_rows, low=0)
        if tile_rows and not int8_activations:
            raise ValueError("tile_rows of a quantized weight needs int8_activations (tiles multiply codes)")
        if tile_rows and not self.tiles:
            raise ValueError(f"tile_rows needs AMX tiles, which the {self.level.name} build here has not")
        fmt = WEIGHT_Q4 if weight.bits == 4 else WEIGHT_Q8
        return KernelWeight(
            fmt, weight.n, weight.k, weight.codes, weight.scales, weight.mins, dense_rows, tile_rows,
            activations=INT8_ACTIVATIONS if int8_activations else 0,
        )  # fmt: skip

    def quantized_rows(self, weight: KernelWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[num_ids, k] in `dtype` (bf16 or float32): rows `ids` (int64 [num_ids]) of the quantized table
        `weight` (quantized_weight's), each value as QuantizedTensor.rows computes it (csrc/quant_rows.c):
        a quantized model's token embedding."""
        if weight.format not in (WEIGHT_Q4, WEIGHT_Q8):
            raise ValueError("quantized_rows needs a quantized weight (quantized_weight's)")
        if dtype not in DTYPE_CODES:
            raise ValueError(f"dtype must be one of {', '.join(map(str, DTYPE_CODES))}, got {dtype}")
        ids = _index_tensor("ids", ids, torch.int64, (None,), "")
        out = torch.empty(ids.shape[0], weight.k, dtype=dtype)
        status = self._quantized_rows(
            weight.ptr, ids.data_ptr(), ids.shape[0], out.data_ptr(), DTYPE_CODES[dtype]
        )
        _check(status, f"quantized_rows: ids must be in [0, {weight.n})")
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [rows]: torch.argmax(logits, dim=-1) of float32 logits [rows, vocab] (argmax.c)."""
        _check_tensor("logits", logits, torch.float32, (None, None))
        rows, vocab = logits.shape
        if vocab < 1:
            raise ValueError(f"logits must have at least one column, got {_shape(logits)}")
        out = torch.empty(rows, dtype=torch.int64)
        _check(self._argmax_f32(logits.data_ptr(), rows, vocab, out.data_ptr()), f"argmax: {_shape(logits)}")
        return out

    def rms_norm(
        self,
        x: torch.Tensor,  # [..., size]
        weight: torch.Tensor,  # [size]
        eps: float,
    ) -> torch.Tensor:
        """x: [..., size] -> RMSNorm(x) * weight, same shape; numerics of layers.RMSNorm."""
        _check_tensor("x", x, DTYPE_CODES)
        if x.dim() == 0:
            raise ValueError(f"x must be [..., size], got {_shape(x)}")
        if not (fit := fits(self.limits, row=x.shape[-1])):
            raise ValueError(
                f"x must be [..., size] within the C kernels' limits, got {_shape(x)}: {fit.reason}"
            )
        size = x.shape[-1]
        _check_tensor("weight", weight, x.dtype, (size,), against="x")
        _check_finite("eps", eps, low=0.0)
        out = torch.empty_like(x)
        status = self._rms_norm(
            x.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.numel() // size,
            size,
            eps,
            DTYPE_CODES[x.dtype],
        )
        _check(status, f"rms_norm: rows of {size} (at most {self.limits.max_row})")
        return out

    def qkv_rope_cache(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim] or [num_tokens, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim] or [num_tokens, head_dim]
        q_norm: torch.Tensor | None,  # [head_dim] (Qwen3) or None
        k_norm: torch.Tensor | None,  # [head_dim] (Qwen3) or None
        eps: float,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [num_tokens]
        num_heads: int,
        want_keys: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-head norms, RoPE and the KV-cache write of one layer in one pass.

        Returns q [num_tokens, num_heads, head_dim] and, with want_keys, k [num_tokens, num_kv_heads,
        head_dim]; the values are written to the cache only (the caller's view of qkv has them).
        """
        _check_kv_cache(kv_cache)
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        if not (fit := fits(self.limits, head_dim=head_dim, rotary=True)):
            raise ValueError(f"kv_cache must fit the C kernels: {fit.reason}")
        _check_count("num_heads", num_heads, low=1)
        width = (num_heads + 2 * num_kv_heads) * head_dim
        _check_tensor("qkv", qkv, kv_cache.dtype, (None, width), against="num_heads and kv_cache")
        num_tokens = qkv.shape[0]
        for name, angles in (("cos", cos), ("sin", sin)):
            is_3d = isinstance(angles, torch.Tensor) and angles.dim() == 3
            rows = (num_tokens, 1, head_dim) if is_3d else (num_tokens, head_dim)
            _check_tensor(name, angles, kv_cache.dtype, rows, against="qkv and kv_cache")
        for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
            if norm is not None:
                _check_tensor(name, norm, kv_cache.dtype, (head_dim,), against="kv_cache")
        _check_finite("eps", eps, low=0.0)
        slot_mapping = _index_tensor("slot_mapping", slot_mapping, torch.int64, (num_tokens,), "qkv")
        q = qkv.new_empty(num_tokens, num_heads, head_dim)
        k = qkv.new_empty(num_tokens, num_kv_heads, head_dim) if want_keys else None
        status = self._qkv_rope_cache(
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            None if q_norm is None else q_norm.data_ptr(),
            None if k_norm is None else k_norm.data_ptr(),
            slot_mapping.data_ptr(),
            kv_cache.data_ptr(),
            q.data_ptr(),
            None if k is None else k.data_ptr(),
            num_tokens,
            num_heads,
            num_kv_heads,
            head_dim,
            num_blocks * block_size,
            eps,
            DTYPE_CODES[qkv.dtype],
        )
        _check(status, "slot_mapping: a KV slot is outside kv_cache")
        return q, k

    def decode_attention(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
        block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
        seq_lens: torch.Tensor,  # int32 [num_seqs]
        scale: float,
    ) -> torch.Tensor:  # [num_seqs, num_heads * head_dim] in q's dtype
        _check_kv_cache(kv_cache)
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        if not (fit := fits(self.limits, head_dim=head_dim, block_size=block_size)):
            raise ValueError(f"kv_cache must fit the C kernels: {fit.reason}")
        _check_tensor("q", q, kv_cache.dtype, (None, None, head_dim), contiguous=False, against="kv_cache")
        num_seqs, num_heads, _ = q.shape
        if not (fit := fits(self.limits, num_heads=num_heads, num_kv_heads=num_kv_heads)):
            raise ValueError(f"q's heads must fit the C kernels with kv_cache's: {fit.reason}")
        block_tables = _index_tensor("block_tables", block_tables, torch.int32, (num_seqs, None), "q")
        seq_lens = _index_tensor("seq_lens", seq_lens, torch.int32, (num_seqs,), "q")
        _check_finite("scale", scale)
        q = q.contiguous()
        out = torch.empty(num_seqs, num_heads * head_dim, dtype=q.dtype)
        status = self._decode_attention(
            q.data_ptr(),
            kv_cache.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            num_blocks,
            block_size,
            block_tables.shape[1],
            scale,
            DTYPE_CODES[q.dtype],
        )
        if status == -2:
            raise MemoryError(f"decode attention: no scratch memory for {num_seqs} rows")
        _check(status, "a sequence length (seq_lens) or block id (block_tables) is outside kv_cache")
        return out


WEIGHT_BF16, WEIGHT_Q4, WEIGHT_Q8, WEIGHT_F32 = 1, 2, 3, 4  # csrc/weight.h's formats
INT8_ACTIVATIONS = 8  # csrc/weight.h's activations: each row's inputs rounded to int8 per block of 32


class _WeightDescriptor(ctypes.Structure):
    _fields_ = [  # csrc/weight.h's TandemWeight
        ("format", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("data", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("dense_rows", ctypes.c_int64),
        ("tile_rows", ctypes.c_int64),
        ("activations", ctypes.c_int64),
    ]


class KernelWeight:
    """A linear's weight as the C kernels take it: weight.h's descriptor (at `ptr`) and the arrays it
    points at, held for as long as this object lives. Built by Kernels.pack_weight, float_weight or
    quantized_weight."""

    def __init__(
        self,
        fmt: int,
        n: int,
        k: int,
        data: torch.Tensor,
        scales: torch.Tensor | None = None,
        mins: torch.Tensor | None = None,
        dense_rows: int = 0,
        tile_rows: int = 0,  # packed bf16 or int8 activations: calls of this many rows on tile (0: never)
        activations: int = 0,  # quantized: INT8_ACTIVATIONS, or 0 (inputs in the call's dtype)
    ) -> None:
        self.format, self.n, self.k = fmt, n, k
        self.data, self.scales, self.mins = data, scales, mins
        self.tile_rows = tile_rows
        self.activations = activations
        self._descriptor = _WeightDescriptor(
            fmt, n, k, data.data_ptr(), _ptr_of(scales), _ptr_of(mins), dense_rows, tile_rows, activations
        )
        self.ptr = ctypes.addressof(self._descriptor)


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def is_plain(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """The one question every kernel asks first: a contiguous, strided CPU tensor of `dtype`, that a
    pointer to its first element describes in full."""
    return (
        t.dtype == dtype
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_neg()
    )


def _shape(t: torch.Tensor) -> str:
    return f"[{', '.join(str(n) for n in t.shape)}]"


def _check_tensor(
    name: str,
    t: object,
    dtype: torch.dtype | Mapping[torch.dtype, int],
    shape: tuple[int | None, ...] | None = None,  # None entries take any size
    contiguous: bool = True,
    against: str = "",  # the arguments the dtype and shape come from, named in the error too
) -> None:
    """Raises ValueError naming `name` unless `t` is a plain CPU tensor the kernel can read in place."""
    matching = f" to match {against}" if against else ""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_neg():
        raise ValueError(f"{name} must be a plain strided CPU tensor, got {t.layout} on {t.device}")
    if isinstance(dtype, torch.dtype) and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}{matching}, got {t.dtype}")
    if not isinstance(dtype, torch.dtype) and t.dtype not in dtype:
        raise ValueError(f"{name} must be one of {', '.join(map(str, dtype))}, got {t.dtype}")
    if shape is not None and (
        t.dim() != len(shape)
        or any(want is not None and got != want for got, want in zip(t.shape, shape, strict=True))
    ):
        wanted = ", ".join("*" if n is None else str(n) for n in shape)
        raise ValueError(f"{name} must have shape [{wanted}]{matching}, got {_shape(t)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_kv_cache(kv_cache: torch.Tensor) -> None:
    _check_tensor("kv_cache", kv_cache, DTYPE_CODES, (2, None, None, None, None))
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if min(block_size, num_kv_heads, head_dim) < 1:
        raise ValueError(
            f"kv_cache must have block_size, num_kv_heads and head_dim >= 1, got {_shape(kv_cache)}"
        )


def _index_tensor(
    name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int | None, ...], against: str
) -> torch.Tensor:
    """A contiguous copy when needed (index tensors are small); the C side range-checks the values."""
    _check_tensor(name, t, dtype, shape, contiguous=False, against=against)
    return t.contiguous()


def _check_count(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check_finite(name: str, value: object, low: float | None = None) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or (low is not None and value < low):
        bound = f" >= {low}" if low is not None else ""
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")


def _bind(fn: Any, argtypes: list[Any]) -> Any:
    fn.restype = ctypes.c_int
    fn.argtypes = argtypes
    return fn


def _check(status: int, what: str) -> None:
    if status != 0:
        raise ValueError(f"C kernel refused its input: {what}")


def library_path(level: Level) -> Path:
    """Where setup.py put this level's library: beside this file, named as an extension module."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"{module_name(level)}{suffix}"
        if candidate.is_file():
            return candidate
    raise KernelsUnavailable(
        f"no {level.name} build of the CPU kernels in {here} (they are built by `pip install -e .` / "
        "`make setup`; a C compiler is needed then, not at run time)"
    )


@cache
def load(level: Level) -> Kernels:
    """This level's library, loaded once per process; KernelsUnavailable says why it cannot be."""
    path = library_path(level)
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        raise KernelsUnavailable(f"{path.name} cannot be loaded: {error}") from error
    library.tandem_build_id.restype = ctypes.c_char_p
    built, expected = library.tandem_build_id().decode(), build_id(level)
    if built != expected:
        raise KernelsUnavailable(
            f"{path.name} was built from other sources (build {built}, sources {expected}): rebuild it with "
            "`make setup` or `pip install -e .`"
        )
    return Kernels(library, level, path)


@cache
def load_for_cpu(cpu: CpuInfo | None = None) -> Kernels | None:
    """The highest level this CPU runs; None, with one log line saying why, when it is unavailable."""
    cpu = cpu or this_cpu()
    level = best_level(cpu)
    try:
        return load(level)
    except KernelsUnavailable as error:
        log.warning("CPU kernels unavailable, the model runs on torch ops: %s", error)
        return None
