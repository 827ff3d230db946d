"""A LoRA adapter in PEFT's format, read without peft: `adapter_config.json` + `adapter_model.safetensors`.

Only safetensors is read (never `adapter_model.bin`: a pickle). Every rule is checked before
anything is kept, so a refused adapter leaves nothing behind, and each refusal names the file and
the field at fault. The rules are what the serving side can honour exactly: plain LoRA (no DoRA, no
bias terms, no `modules_to_save`, no per-module rank or alpha patterns) on the attention and MLP
projections (q/k/v/o, gate/up/down), rank at most --max-lora-rank, and every tensor of the shape
the base model's own projection has (so an adapter made for another base model, whose hidden size
or head counts differ, fails naming the first tensor that does not fit).

Scaling is PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`. Which settings of
adapter_config.json are honoured, and which tensors peft would load by them: peft_config.py. A tensor
peft would not load is refused, as is an update whose gain (scale x |A| x |B|) is past MAX_LORA_GAIN.
A module the config targets but the file holds no tensors for is served unadapted where peft's init
leaves it so (B @ A zero: init_lora_weights true, the default), and refused where peft gives it random
weights of its own (false, null): peft's tokens then differ from any other server's, and from its own
at the next load.

NOTE: how the files are read. The directory is opened once and each file relative to it, without
blocking (a FIFO swapped in after any check would hold the one adapter-reader thread, every later load
and the server's exit for ever: the open is O_NONBLOCK and anything fstat does not call a regular file
is refused; a name that led to no regular file when it was looked up, by find or just before, is refused
unopened, as opening a device acts on it, and the open is O_NOCTTY), and read whole into memory from
that descriptor, never memory-mapped: a mapped file that shrinks under the reader (`cp` over it
truncates, then writes) kills the process with SIGBUS, and every stream on the server with it. The read
is bounded by the file's size at open, and that size by what an adapter of its r for this base model can
hold; a file whose size, mtime or change time moved during the read is refused (`cp -p` sets the mtime
back over a same-size rewrite; no call sets the change time back). A directory AdapterRoot.find resolved
inside --lora-root (`found`) is never opened by its path: the read walks from the root's descriptor, one
component at a time, along the path find resolved (beneath.py: no symlink is followed, so a directory
swapped for one leading out since is refused), and opens each file where its name led then, which must
still be the file find saw, reached by the same entry (a symlink swapped in for the name, or for any
directory on the way, is refused; one that was there, into an HF cache's blobs/, still reads). No
refusal formats an OS or library error that may hold the server's own path: a refusal names the
directory as `shown`.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from tandem.common.checkpoint import MAX_JSON_BYTES, json_object
from tandem.decoder.models.adapter_error import AdapterError
from tandem.decoder.models.beneath import MAX_PATH_BYTES, OpenDirectory, open_beneath
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.peft_config import (
    CONFIG_FILE,
    TARGETS,
    AdapterSettings,
    check_config,
    module_key,
)

WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
# A safetensors header past its 8-byte length: ~130 bytes a tensor, 14 tensors a layer (1 MiB is ~570
# layers), and PEFT's metadata is {"format": "pt"}. What an adapter's file may hold beyond its tensors.
MAX_HEADER_BYTES = 4 << 20
# The widest floating-point dtype safetensors holds (F64): a tensor's most bytes per value.
MAX_ITEM_BYTES = 8

# O_NOCTTY: a terminal device swapped in between the type's check and the open never becomes the
# server's controlling terminal (the open is then refused as another file).
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# What open(2) with O_NOFOLLOW says of a symlink: ENOTDIR (Linux, with O_DIRECTORY), ELOOP (Linux,
# macOS), EMLINK (FreeBSD): a symlink, or a file, stands where a directory or the file was.
_SYMLINK_REFUSED = (errno.ENOTDIR, errno.ELOOP, errno.EMLINK)
# And ENOENT of nothing there. All mean the path names no directory.
_NOT_A_DIRECTORY = (errno.ENOENT, *_SYMLINK_REFUSED)
_MAX_READ_BYTES = 1 << 30  # one read(2); Linux returns at most ~2 GiB a call

# What a LoRA weight may be stored as: the floating-point dtypes whose values torch checks and casts.
_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The largest gain (scale x |A| x |B|, Frobenius norms: an upper bound of the update's spectral norm) an
# adapter's update may have. Trained ones sit near 1 to 10 (scale 0.5 to 4, |A| ~ sqrt(r / 3) from its
# init, |B| below 1); random ones are larger: ~100 for bench/lora_throughput.py's (std 0.02, r 16, scale 2)
# at Llama-3-8B's 4,096 x 14,336, below 100 for the tests' peft-made ones. At 1e6 an input of unit norm
# leaves the update past float16's range (65,504) 15 times over, a millionfold the base projection's own
# (norm near 1): no fine-tune does that, only overflow, where the output was garbage with no error.
MAX_LORA_GAIN = 1e6

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT strips the adapter's name): the
# names of modules the base model has, and nothing else, as PEFT loads only those. A layer index with a
# leading zero ("layers.00.") names no module, and read as a number it was layer 0 again, the later of
# the two tensors kept; "self_attn.up_proj" names none either; and 5,000 digits failed int() (INTERNAL).
_TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(0|[1-9]\d{0,8})\."
    r"(?:self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))\.lora_(A|B)\.weight"
)


@dataclass(frozen=True)
class FileIdentity:
    """Which file a name led to when it was checked: the same file wherever it is linked from."""

    device: int  # st_dev
    inode: int  # st_ino

    @classmethod
    def of(cls, status: os.stat_result) -> FileIdentity:
        return cls(device=status.st_dev, inode=status.st_ino)


@dataclass(frozen=True)
class FoundFile:
    """Where an adapter file's name led inside --lora-root when AdapterRoot.find walked it."""

    # What the name's symlink said (an HF snapshot's, into blobs/); None: the name was the file itself.
    # Not the symlink's inode: one unlinked and made again with another target often gets the same.
    link: str | None
    parts: tuple[str, ...]  # the file's path below the root, no symlink on it (beneath.resolve)
    identity: FileIdentity  # the file there
    # Its stat.S_IFMT: anything but a regular file is refused before it is opened (opening a device
    # may act on it: a tape rewinds, a modem hangs up).
    file_type: int

    @property
    def is_regular(self) -> bool:
        return self.file_type == stat.S_IFREG


@dataclass(frozen=True)
class FoundAdapter:
    """An adapter directory AdapterRoot.find resolved inside --lora-root: all that its read may open."""

    root: OpenDirectory  # the root, held open: every walk starts at its descriptor
    directory: tuple[str, ...]  # the directory's path below the root, no symlink on it
    # Each adapter file's name -> where it led; a name missing led nowhere (nothing, a dangling symlink).
    files: Mapping[str, FoundFile]


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter's weights, checked against one base model; not yet in any slot."""

    rank: int  # r
    scale: float  # lora_alpha / r (rsLoRA: / sqrt(r))
    targets: tuple[str, ...]  # the checkpoint modules it adapts, in TARGETS order
    # (layer, module) -> (A [rank, in_features], B [out_features, rank]), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_parameters(self) -> int:
        return sum(a.numel() + b.numel() for a, b in self.weights.values())


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each target module in the base model's checkpoint."""
    c = config
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "q_proj": (q_size, c.hidden_size),
        "k_proj": (kv_size, c.hidden_size),
        "v_proj": (kv_size, c.hidden_size),
        "o_proj": (c.hidden_size, q_size),
        "gate_proj": (c.intermediate_size, c.hidden_size),
        "up_proj": (c.intermediate_size, c.hidden_size),
        "down_proj": (c.hidden_size, c.intermediate_size),
    }


def max_weights_bytes(config: ModelConfig, rank: int) -> int:
    """The largest adapter_model.safetensors an adapter of rank `rank` for this base model can be: every
    target module of every layer, A and B, in float64, and its header."""
    values_per_layer = sum(
        rank * (out_features + in_features) for out_features, in_features in module_shapes(config).values()
    )
    return 8 + MAX_HEADER_BYTES + MAX_ITEM_BYTES * config.num_layers * values_per_layer


def read_adapter(
    path: str | Path,
    config: ModelConfig,
    max_rank: int,
    shown: str | None = None,
    found: FoundAdapter | None = None,
) -> LoraAdapter:
    """The adapter in directory `path`, checked against a base model of `config`. Raises AdapterError.
    `shown`: the directory as refusals name it, `path` by default (a LoadAdapter caller under
    --lora-root sees the path it named relative to the root, never the server's own).
    `found` None: `path` is the operator's (--lora), followed wherever it leads. Otherwise `path` (only
    checked and logged) was resolved inside --lora-root as `found`, and the read opens what `found` says
    from the root's descriptor: a symlink standing on its path now, or a file other than the one found,
    was swapped in since by a writer of the root and may lead out, so it is refused, never followed."""
    if not str(path):
        raise AdapterError("path", "must not be empty (it would name the server's working directory)")
    # The operator's path only: a caller's was checked as it was sent (AdapterRoot.find), and the one it
    # resolved to is opened by its parts, from the root's descriptor, whatever its length with the root's
    # (which is no caller's business) and its bytes (a name in no encoding, as fsencode keeps it).
    if found is None and (num_bytes := len(os.fsencode(path))) > MAX_PATH_BYTES:
        raise AdapterError("path", f"must be at most {MAX_PATH_BYTES} bytes, got {num_bytes}")
    shown = str(path) if shown is None else shown
    try:
        if found is None:
            directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        else:
            directory = open_beneath(found.root.fd, found.directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        if error.errno in _NOT_A_DIRECTORY:
            raise AdapterError(
                "path", f"{shown} is not a directory ({CONFIG_FILE} + {WEIGHTS_FILE})"
            ) from None
        # A name over NAME_MAX, a directory that cannot be listed...
        raise AdapterError("path", f"cannot be read: {error.strerror}") from None
    try:
        return _read_directory(directory, config, max_rank, shown, found)
    finally:
        os.close(directory)


def _read_directory(
    directory: int, config: ModelConfig, max_rank: int, shown: str, found: FoundAdapter | None
) -> LoraAdapter:
    """read_adapter's work, every file opened relative to the open `directory`."""
    config_bytes = _read_file(
        directory, CONFIG_FILE, shown, found, MAX_JSON_BYTES, "a JSON file of a checkpoint may"
    )
    if config_bytes is None:
        raise _ConfigFileError(f"{CONFIG_FILE} not found in {shown}")
    settings = check_config(
        json_object(config_bytes, f"{shown}/{CONFIG_FILE}", _ConfigFileError),
        max_rank,
        config.num_layers,
        has_qk_norm=config.has_qk_norm,
    )
    rank = settings.rank
    max_bytes = max_weights_bytes(config, rank)
    weights_bytes = _read_file(
        directory,
        WEIGHTS_FILE,
        shown,
        found,
        max_bytes,
        f"an adapter of r {rank} for this base model can hold",
    )
    if weights_bytes is None:
        try:  # the name itself, inside the directory: a symlink is not followed (it may lead anywhere)
            os.stat(PICKLE_FILE, dir_fd=directory, follow_symlinks=False)
            hint = f" ({PICKLE_FILE} is a pickle, never read: save it as safetensors)"
        except OSError:
            hint = ""
        raise AdapterError(WEIGHTS_FILE, f"not found in {shown}{hint}")
    weights = _read_weights(weights_bytes, config, settings)
    _check_absent(weights, config, settings, shown)
    targets = tuple(t for t in TARGETS if any(module == t for _, module in weights))
    return LoraAdapter(rank=rank, scale=settings.scale, targets=targets, weights=weights)


def _read_file(
    directory: int,
    name: str,
    shown: str,
    found: FoundAdapter | None,
    max_bytes: int,
    limit: str,
) -> bytes | None:
    """The whole of regular file `name` in `directory`, read from one descriptor; None where nothing is
    there. Raises AdapterError naming the file: not the file `found` says the name led to (checked
    before anything of it is told: its kind, size or bytes may be another's), not a regular file, over
    `max_bytes` (`limit` says whose bound it is), unreadable, or changed while it was read."""
    was = None if found is None else found.files.get(name)
    try:
        if found is not None and was is None:  # the name led nowhere at find: nothing there is opened
            return _absent(directory, name, shown)
        if was is not None and not was.is_regular:  # a device, a FIFO...: refused unopened
            raise AdapterError(name, f"must be a regular file in {shown}")
        fd = _open_file(directory, name, shown, found, was)
    except FileNotFoundError:  # a dangling symlink too
        return None
    except OSError as error:
        if found is not None and error.errno in _SYMLINK_REFUSED:  # a symlink standing where it was not
            raise _changed(name, shown) from None
        # strerror only: the exception's own text names the server's path
        raise AdapterError(name, f"cannot be read: {error.strerror}") from None
    try:
        before = os.fstat(fd)
        if found is not None and (None if was is None else was.identity) != FileIdentity.of(before):
            raise _changed(name, shown)
        if not stat.S_ISREG(before.st_mode):
            raise AdapterError(name, f"must be a regular file in {shown}")
        if before.st_size > max_bytes:
            raise AdapterError(name, f"has {before.st_size:,} bytes, more than the {max_bytes:,} {limit}")
        chunks = []
        num_left = before.st_size
        while num_left > 0 and (chunk := os.read(fd, min(num_left, _MAX_READ_BYTES))):
            chunks.append(chunk)
            num_left -= len(chunk)
        after = os.fstat(fd)
    except OSError as error:
        raise AdapterError(name, f"cannot be read: {error.strerror}") from None
    finally:
        os.close(fd)
    if num_left or _version(after) != _version(before):
        raise _changed(name, shown)
    return b"".join(chunks)


def _open_file(
    directory: int, name: str, shown: str, found: FoundAdapter | None, was: FoundFile | None
) -> int:
    """`name`'s descriptor: in `directory` as it leads (`found` None: the operator's), else where find saw
    it lead, by the same symlink if it was one (another swapped in since is refused), with no symlink
    followed; a name find saw lead nowhere, in `directory` as it is, never followed (refused unread)."""
    if found is None:
        if not stat.S_ISREG(os.stat(name, dir_fd=directory).st_mode):  # refused unopened, as above
            raise AdapterError(name, f"must be a regular file in {shown}")
        return os.open(name, _OPEN_FLAGS, dir_fd=directory)
    assert was is not None
    if was.link is not None:
        try:
            link = os.readlink(name, dir_fd=directory)
        except OSError as error:
            if error.errno != errno.EINVAL:  # ENOENT: gone, as a file gone is
                raise
            link = None  # no symlink now: a file swapped in for it
        if link != was.link:
            raise _changed(name, shown)
    return open_beneath(found.root.fd, was.parts, _OPEN_FLAGS)


def _absent(directory: int, name: str, shown: str) -> None:
    """None where `name`, which led nowhere when find walked it, leads nowhere yet (nothing there, a
    symlink: not followed); anything standing there now was put there since, and is refused unopened."""
    try:
        status = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(status.st_mode):
        return None
    raise _changed(name, shown)


def _version(status: os.stat_result) -> tuple[int, int, int]:
    """What a write to the file moves. Not st_ino: one descriptor's file is the same inode throughout."""
    return status.st_size, status.st_mtime_ns, status.st_ctime_ns


def _changed(name: str, shown: str) -> AdapterError:
    return AdapterError(name, f"changed while it was read (being written?): load {shown} once it is whole")


class _ConfigFileError(AdapterError):
    """adapter_config.json missing or not a JSON object."""

    def __init__(self, message: str) -> None:
        super().__init__(CONFIG_FILE, message)


def _read_weights(
    data: bytes, config: ModelConfig, settings: AdapterSettings
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    shapes, rank = module_shapes(config), settings.rank
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, str], str] = {}  # (layer, module) -> its lora_B tensor's name
    try:  # safetensors checks the header (its length, offsets, dtypes) against the bytes read
        tensors = load_safetensors(data)
    except SafetensorError as error:  # parsed from memory: its message names no path
        raise AdapterError(WEIGHTS_FILE, f"is not a safetensors file: {error}") from None
    for name in sorted(tensors):
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise AdapterError(
                f"{WEIGHTS_FILE}:{name}",
                "is not a LoRA weight of a decoder layer's self_attn.q_proj, k_proj, v_proj, o_proj or "
                "mlp.gate_proj, up_proj, down_proj",
            )
        layer, module, half = int(match.group(1)), match.group(2) or match.group(3), match.group(4)
        if layer >= config.num_layers:
            raise AdapterError(
                f"{WEIGHTS_FILE}:{name}", f"names layer {layer}; the base model has {config.num_layers}"
            )
        # Refused, not dropped: a tensor peft would not load says the file and its config disagree.
        if (why := settings.why_not_adapted(layer, module)) is not None:
            raise AdapterError(f"{WEIGHTS_FILE}:{name}", why)
        out_features, in_features = shapes[module]
        want = (rank, in_features) if half == "A" else (out_features, rank)
        tensor = tensors[name]
        shape = tuple(tensor.shape)
        if shape != want:
            raise AdapterError(
                f"{WEIGHTS_FILE}:{name}",
                f"has shape {list(shape)}, expected {list(want)} (r {rank} and the base model's "
                f"{module}: in {in_features}, out {out_features})",
            )
        # Before any arithmetic on it: float8 has no isfinite (INTERNAL), an integer no NaN to find.
        if tensor.dtype not in _WEIGHT_DTYPES:
            stored = str(tensor.dtype).removeprefix("torch.")
            raise AdapterError(
                f"{WEIGHTS_FILE}:{name}",
                f"is stored as {stored}: must be F16, BF16, F32 or F64 (floating point)",
            )
        if not torch.isfinite(tensor).all():
            raise AdapterError(f"{WEIGHTS_FILE}:{name}", "must hold finite floating-point values")
        # Finite in the file's float64 may be Inf once in float32, or in the slots' dtype
        # (float16 ends at 65504): every request on the adapter would then sample from NaN.
        if not (torch.isfinite(tensor.float()).all() and torch.isfinite(tensor.to(config.dtype)).all()):
            dtype = str(config.dtype).removeprefix("torch.")
            raise AdapterError(
                f"{WEIGHTS_FILE}:{name}", f"holds values beyond float32's or the model's {dtype} range"
            )
        halves.setdefault((layer, module), {})[half] = tensor.float()
        names[(layer, module)] = name.replace(".lora_A.", ".lora_B.")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterError(WEIGHTS_FILE, f"layer {layer} {module} has no {missing} weight")
        # scale * |A| * |B| (Frobenius norms, in float64) bounds the update's gain, |scale * B @ A| for
        # any input. Past MAX_LORA_GAIN every request on the adapter emits garbage with no error: with
        # lora_alpha 1e30 the hidden states overflow, and the logits came out finite but flat (token 0,
        # logprob -ln(vocab) for ever), so the sampler's non-finite check never saw them.
        gain = settings.scale * pair["A"].double().norm().item() * pair["B"].double().norm().item()
        if not abs(gain) <= MAX_LORA_GAIN:
            raise AdapterError(
                f"{WEIGHTS_FILE}:{names[(layer, module)]}",
                f"with lora_alpha / r = {settings.scale:.3g} this update can multiply an input by "
                f"{abs(gain):.3g} (scale x |A| x |B|), over the {MAX_LORA_GAIN:.0e} past which no model's "
                f"activations stay meaningful (from {CONFIG_FILE}:lora_alpha or the weights)",
            )
        weights[(layer, module)] = (pair["A"], pair["B"])
    if not weights:
        raise AdapterError(WEIGHTS_FILE, "holds no LoRA weights")
    return weights


def _check_absent(
    weights: Mapping[tuple[int, str], object], config: ModelConfig, settings: AdapterSettings, shown: str
) -> None:
    """Refuses an adapter whose config targets modules its file holds no tensors for, unless peft's init
    leaves such a module as the base model has it (peft_config.py's NOTE): peft adapts every module the
    config targets, a missing one with its init's A and B and only a warning, and vLLM leaves it
    unadapted whatever the init; serving the file alone then gives other tokens than peft with no error."""
    if settings.absent_is_base:
        return
    absent = [
        (layer, module)
        for layer in range(config.num_layers)
        for module in TARGETS
        if (layer, module) not in weights and settings.why_not_adapted(layer, module) is None
    ]
    if absent:
        more = f" and {len(absent) - 1} more module(s)" if len(absent) > 1 else ""
        raise AdapterError(
            WEIGHTS_FILE,
            f"in {shown} holds no lora_A/lora_B for {module_key(*absent[0])}{more}, which "
            f"{CONFIG_FILE}:target_modules targets; with init_lora_weights "
            f"{json.dumps(settings.init_lora_weights)} peft gives such a module random weights of its "
            "own (other tokens, only a warning): save every targeted module's weights, narrow "
            "target_modules to those saved, or set init_lora_weights true where the absent ones were left "
            "untrained (peft then leaves them as the base model has them)",
        )
