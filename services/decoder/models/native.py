"""Builds `native_kernels.c` with the machine's C compiler and calls it through ctypes.

Why not a torch C++ extension: compiling against torch's headers takes about a minute on two cores;
this file is plain C that compiles in about a second, once per machine, into a cache keyed by the
source, the compiler and the CPU. Tensors are passed as data pointers, after the wrapper has checked
their device, dtype, shape and contiguity (ValueError naming the argument otherwise): the C side
cannot see a buffer's size, so it trusts those, and checks the slots, block ids and lengths itself.

`load()` returns None (and says why in the log) when there is no compiler, the build fails or the
cache directory is not private to this user; the model then keeps its torch path. Both paths are
tested against the same dense reference. How the cache is trusted: the NOTE above `build`.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import math
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_kernels.c")
# Compiled into the same library (the bf16 linear layers, the fused layer halves), and the headers
# they include; all hashed.
LINEAR_SOURCE = Path(__file__).with_name("linear_kernels.c")
LAYER_SOURCE = Path(__file__).with_name("layer_kernels.c")
HEADERS = (Path(__file__).with_name("native_bf16.h"), Path(__file__).with_name("native_exp.h"))
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
    """The loaded library, with one typed wrapper per kernel.

    The C side reads and writes through raw pointers and can check only the indices it is given (slots,
    block ids, lengths): every wrapper checks each tensor's device, dtype, shape and contiguity before
    the call, and raises ValueError naming the argument. `supports_*` answer a different question:
    whether well-formed inputs fit the kernel at all (else the caller keeps its torch path).
    """

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
        # The raw bf16 linear (linear_kernels.c); call it through native_linear.NativeLinear, which
        # checks every tensor it hands over.
        self.linear_bf16 = _bind(library.tandem_linear_bf16, pointers * 4 + sizes * 3)
        # The raw fused layer halves (layer_kernels.c); call them through native_layer.NativeLayer.
        real = [ctypes.c_float]
        self.attention_in = _bind(
            library.tandem_attention_in,
            pointers * 2 + real + pointers * 4 + real + pointers * 4 + sizes + pointers * 3 + sizes * 5,
        )
        self.mlp_block = _bind(library.tandem_mlp_block, pointers * 5 + real + pointers * 4 + sizes * 4)
        # Every layer of a decode-only step (layer_kernels.c); call it through native_stack.NativeStack.
        self.decode_layers = _bind(
            library.tandem_decode_layers,
            pointers * 3 + sizes + real + pointers * 5 + sizes * 3 + real + pointers * 2 + sizes * 6,
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

    def rms_norm(
        self,
        x: torch.Tensor,  # [..., size]
        weight: torch.Tensor,  # [size]
        eps: float,
    ) -> torch.Tensor:
        """x: [..., size] -> RMSNorm(x) * weight, same shape; numerics of layers.RMSNorm."""
        _check_tensor("x", x, DTYPE_CODES)
        if x.dim() == 0 or not 1 <= x.shape[-1] <= MAX_ROW:
            raise ValueError(f"x must be [..., size] with size in [1, {MAX_ROW}], got {_shape(x)}")
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
        _check(status, f"rms_norm: rows of {size} (at most {MAX_ROW})")
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
        if head_dim % 2 or head_dim > MAX_HEAD_DIM:
            raise ValueError(f"kv_cache head_dim must be even and at most {MAX_HEAD_DIM}, got {head_dim}")
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
        _check_kv_cache(kv_cache)
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        if head_dim > MAX_HEAD_DIM or block_size > MAX_BLOCK_SIZE:
            raise ValueError(
                f"kv_cache head_dim ({head_dim}) and block_size ({block_size}) must be at most "
                f"{MAX_HEAD_DIM} and {MAX_BLOCK_SIZE}"
            )
        _check_tensor("q", q, kv_cache.dtype, (None, None, head_dim), contiguous=False, against="kv_cache")
        num_seqs, num_heads, _ = q.shape
        if num_heads == 0 or num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
            raise ValueError(
                f"q must have a multiple of kv_cache's num_kv_heads ({num_kv_heads}) heads, at most "
                f"{MAX_GROUP} per KV head, got {num_heads}"
            )
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


# NOTE: the cache holds code this process runs (loading a library runs its constructors). A library is
# loaded only from a directory that belongs to this user and that no one else can write (created
# 0700), only when the file is ours, not writable by group or others, and hashes to the sha256 written
# beside it when it was built; and it is loaded through the descriptor that was hashed, so it cannot be
# swapped in between. Anything else at its name (planted, corrupt, half written) is rebuilt over.
# Builders hold an flock on the directory, so ranks that start together compile once.


class UntrustedCacheError(RuntimeError):
    """The kernel cache directory, or a file in it, may hold code this user did not build."""


def build(directory: Path | None = None) -> Path:
    """Compiles the kernels unless a verified build is cached; returns the library's path.

    Raises RuntimeError when there is no compiler, the build fails or the cache is not private.
    """
    path, fd = _build(directory or cache_dir())
    os.close(fd)
    return path


def load_from(directory: Path) -> NativeKernels:
    """The kernels from `directory`, built there first when no verified build is cached."""
    path, fd = _build(directory)
    # Loaded through the hashed descriptor, which stays open: glibc knows a loaded library by its
    # name, and a reused descriptor number would name another library.
    name = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path)
    try:
        return NativeKernels(ctypes.CDLL(name), path)
    except BaseException:
        os.close(fd)
        raise


@cache
def load() -> NativeKernels | None:
    """The kernels for this machine, built on first use; None (logged) when they cannot be built."""
    try:
        return load_from(cache_dir())
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("native CPU kernels unavailable, the model stays on torch ops: %s", error)
        return None


def _build(directory: Path) -> tuple[Path, int]:
    """The library's path and a read-only descriptor of it, verified; builds it when needed."""
    compiler = os.environ.get(COMPILER_ENV) or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH (set {COMPILER_ENV} to choose one)")
    key = hashlib.sha256(
        b"\0".join(
            [
                SOURCE.read_bytes(),
                LINEAR_SOURCE.read_bytes(),
                LAYER_SOURCE.read_bytes(),
                *(header.read_bytes() for header in HEADERS),
                " ".join(CFLAGS).encode(),
                _compiler_version(compiler).encode(),
                _cpu_identity().encode(),
            ]
        )
    ).hexdigest()[:16]
    _make_private_directory(directory)
    target = directory / f"tandem_kernels-{key}.so"
    try:
        return target, _open_verified(target)
    except FileNotFoundError:
        pass
    except UntrustedCacheError as error:
        log.warning("rebuilding the native kernels: %s", error)
    with _build_lock(directory):
        try:
            return target, _open_verified(target)  # another process built it while this one waited
        except (FileNotFoundError, UntrustedCacheError):
            _compile(compiler, target)
    return target, _open_verified(target)


def _make_private_directory(directory: Path) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    _check_private(os.stat(directory), directory, stat.S_ISDIR, "directory")


def _check_private(status: os.stat_result, path: Path, is_kind: Callable[[int], bool], kind: str) -> None:
    """Raises UntrustedCacheError unless `path` is a `kind` of this user that no one else can write."""
    if not is_kind(status.st_mode):
        raise UntrustedCacheError(f"{path} is not a {kind}")
    if status.st_uid != os.geteuid():
        raise UntrustedCacheError(f"{path} belongs to uid {status.st_uid}, not to this user ({os.geteuid()})")
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.S_IMODE(status.st_mode)
        raise UntrustedCacheError(f"{path} is writable by group or others (mode {mode:04o})")


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _read_private(path: Path) -> tuple[int, bytes]:
    """An open descriptor of a private regular file and its bytes.

    FileNotFoundError when there is none; UntrustedCacheError for anything else (a symlink included).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise UntrustedCacheError(f"{path}: {error}") from error
    try:
        _check_private(os.fstat(fd), path, stat.S_ISREG, "regular file")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return fd, b"".join(chunks)
    except BaseException:
        os.close(fd)
        raise


def _open_verified(library: Path) -> int:
    """A descriptor of `library` whose bytes match its recorded sha256.

    FileNotFoundError when it is not built; UntrustedCacheError when it or its digest is not ours, is
    writable by others, is missing or does not match (a planted, corrupt or half-written file).
    """
    fd, content = _read_private(library)  # FileNotFoundError passes: nothing is built there yet
    try:
        digest_fd, recorded = _read_private(_digest_path(library))
        os.close(digest_fd)
        if hashlib.sha256(content).hexdigest() != recorded.decode(errors="replace").strip():
            raise UntrustedCacheError(f"{library} does not match the sha256 recorded when it was built")
        return fd
    except BaseException as error:
        os.close(fd)
        if isinstance(error, OSError):
            raise UntrustedCacheError(f"{library}'s recorded sha256: {error}") from error
        raise


@contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _compile(compiler: str, target: Path) -> None:
    # Built and hashed in a private scratch directory beside the target, then renamed into place: no
    # one sees half a file. The digest goes first: a reader that sees it beside the file it replaces
    # finds a mismatch and waits for the lock, and one that sees it alone finds nothing built yet.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *CFLAGS, "-o", str(built), str(SOURCE), str(LINEAR_SOURCE), str(LAYER_SOURCE)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{result.stderr.strip()}")
        built.chmod(0o700)  # whatever the umask: group-writable files are refused
        digest = _digest_path(built)
        digest.write_text(hashlib.sha256(built.read_bytes()).hexdigest() + "\n")
        digest.chmod(0o600)
        os.replace(digest, _digest_path(target))
        os.replace(built, target)
