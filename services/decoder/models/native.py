"""Builds `native_kernels.c` with the machine's C compiler and calls it through ctypes.

Why not a torch C++ extension: compiling against torch's headers takes about a minute on two cores;
this file is plain C that compiles in about a second, once per machine, into a cache keyed by the
source, the compiler and the CPU. Tensors are passed as data pointers, after the wrapper has checked
their dtype, shape and contiguity: the C side trusts those and checks the block tables itself.

`load()` returns None (and says why in the log) when there is no compiler or the build fails; the
model then keeps its torch path. Both paths are tested against the same dense reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_kernels.c")
# -fopenmp: the library's parallel loops join torch's OpenMP runtime (libgomp.so.1, already loaded).
# No -ffast-math: it would also set flush-to-zero for the whole process when the library loads.
CFLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-std=c11",
)
COMPILER_ENV = "CC"  # the compiler to use; default `cc`
CACHE_ENV = "TANDEM_KERNEL_CACHE"  # where built libraries go; default ~/.cache/tandem/kernels

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM, MAX_GROUP, MAX_BLOCK_SIZE, MAX_ROW = 256, 16, 64, 16384  # the C side's scratch limits


class NativeKernels:
    """The loaded library, with one typed wrapper per kernel."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
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

    @staticmethod
    def _same_cpu_dtype(*tensors: torch.Tensor) -> bool:
        dtype = tensors[0].dtype
        return dtype in DTYPE_CODES and all(
            t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors
        )

    @classmethod
    def supports_norm(cls, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether rms_norm takes these (else the caller keeps its torch path)."""
        return x.shape[-1] <= MAX_ROW and cls._same_cpu_dtype(x, weight)

    @classmethod
    def supports_qkv(
        cls, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor
    ) -> bool:
        """Whether qkv_rope_cache takes these (else the caller keeps its torch path)."""
        head_dim = kv_cache.shape[-1]
        return head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0 and cls._same_cpu_dtype(qkv, cos, sin, kv_cache)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [..., size] -> RMSNorm(x) * weight, same shape; numerics of layers.RMSNorm."""
        size = x.shape[-1]
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
        _check(status, f"rms_norm: rows of {size} (at most {MAX_ROW})")
        return out

    def qkv_rope_cache(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
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
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_tokens = qkv.shape[0]
        if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
            got = f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
            raise ValueError(f"slot_mapping must be int64 [{num_tokens}], got {got}")
        slot_mapping = slot_mapping.contiguous()
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
        _check(status, "qkv_rope_cache: a KV slot is outside the cache")
        return q, k

    @classmethod
    def supports_decode(cls, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether decode_attention takes these tensors (else the caller keeps its torch path)."""
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_heads = q.shape[1]
        return (
            head_dim <= MAX_HEAD_DIM
            and block_size <= MAX_BLOCK_SIZE
            and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP
            and cls._same_cpu_dtype(q, kv_cache)
        )

    def decode_attention(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
        block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
        seq_lens: torch.Tensor,  # int32 [num_seqs]
        scale: float,
    ) -> torch.Tensor:  # [num_seqs, num_heads * head_dim] in q's dtype
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_seqs, num_heads, _ = q.shape
        if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
            raise TypeError("block_tables and seq_lens must be int32")
        if block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
            raise ValueError(
                f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} "
                f"must have num_seqs ({num_seqs}) rows"
            )
        q = q.contiguous()
        block_tables = block_tables.contiguous()
        seq_lens = seq_lens.contiguous()
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
        _check(status, "decode_attention: a sequence length or block id is outside the KV cache")
        return out


def _bind(fn: Any, argtypes: list[Any]) -> Any:
    fn.restype = ctypes.c_int
    fn.argtypes = argtypes
    return fn


def _check(status: int, what: str) -> None:
    if status != 0:
        raise ValueError(f"native kernel refused its input: {what}")


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "tandem" / "kernels"


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU model and flags (a cached build is per CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _compiler_version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True)
    return result.stdout.splitlines()[0] if result.stdout else ""


def build(directory: Path | None = None) -> Path:
    """Compiles the kernels (or finds them built) and returns the library's path.

    Raises RuntimeError with the compiler's output when there is no compiler or the build fails.
    """
    compiler = os.environ.get(COMPILER_ENV) or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH (set {COMPILER_ENV} to choose one)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [
                source,
                " ".join(CFLAGS).encode(),
                _compiler_version(compiler).encode(),
                _cpu_identity().encode(),
            ]
        )
    ).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"tandem_kernels-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: concurrent builders never see half a file.
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *CFLAGS, "-o", str(built), str(SOURCE)], capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{result.stderr.strip()}")
        os.replace(built, target)
    return target


@cache
def load() -> NativeKernels | None:
    """The kernels for this machine, built on first use; None (logged) when they cannot be built."""
    try:
        path = build()
        return NativeKernels(ctypes.CDLL(str(path)), path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("native CPU kernels unavailable, the model stays on torch ops: %s", error)
        return None
