"""The decoder's configuration: one frozen object, validated when built, passed down.

Built once in `__main__` (from flags, or `TANDEM_*` environment variables for flags not given)
or directly by tests and the offline API. Values derived from the loaded model, such as the
number of KV blocks that fit in `kv_cache_bytes`, are computed by the engine and never written
back here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.client.errors import ConfigError, InvalidArgument
from tandem.common.cpus import CGROUP_CPU_MAX, available_cpus, quota_cpus
from tandem.common.dtypes import COMPUTE_NAMES
from tandem.common.model_name import check_adapter_name, check_served_name
from tandem.common.server import DEFAULT_MAX_CONCURRENT_RPCS, ServerOptions
from tandem.common.torch_part.quantized_tensor import BLOCK as QUANTIZATION_BLOCK
from tandem.common.torch_part.quantized_tensor import SCHEMES
from tandem.common.torch_part.torch_dtypes import BY_TORCH
from tandem.decoder.backends import backend as backends
from tandem.decoder.backends.cpu.kernel_options import AUTO as AUTO_KERNELS
from tandem.decoder.backends.cpu.kernel_options import CPU_KERNELS, KernelOptions
from tandem.decoder.backends.cpu.kernels import DTYPE_CODES
from tandem.decoder.models.attention import PagedAttention

DEFAULT_PORT = 50052
# Tokens one decode step may propose and verify beyond its own (prompt lookup), per request and as
# the server default. A verification costs about one step while the step reads weights rather than
# computes; far past that it computes, and a long guess is rarely right to the end.
MAX_SPECULATIVE_TOKENS = 16
# Calls the decoder's server holds beside its requests running and waiting (max_calls), which the
# engine's batch and queue bound. They are shared by every call those do not count: health checks
# (Watch streams have half the places of their own), Tokenize, GetModelInfo, adapter calls,
# reflection, Generate streams still being built (an encoder's parts are fetched for up to 60 s before
# the request is queued), finished ones still sending their last messages to a slow reader, and
# requests paused for their readers (no queue counts them: each holds no slot or KV block and only its
# client ends it; one caller holds at most --max-streams-per-connection, or --max-streams-per-token,
# of them). Past them a call meets the server's bound (RESOURCE_EXHAUSTED naming it) rather than the
# queue's.
NUM_SPARE_CALLS = 1024
# --max-queue at most. At it (--max-num-seqs 64) the server holds 202,176 calls (max_calls), about 20 KB
# each in gRPC core while running, and gRPC core up to 214,812 more (grpc.aio's bound) not yet taken
# up, about 16 KB each: some 4.0 + 3.4 GB at worst beside what the requests themselves hold.
MAX_QUEUE_LIMIT = 100_000
# --max-num-seqs at most, as --max-queue: a running request is a stream the server holds as a waiting
# one is, and no batch comes near it (vLLM's default is 256). At both limits the server holds 402,048
# calls (~8.0 GB running, ~6.8 GB more not yet taken up), within server.MAX_CONCURRENT_RPCS_LIMIT.
MAX_NUM_SEQS_LIMIT = 100_000
# KV slots (block id * block_size + offset) a pool may hold: the step broadcast carries a step's slots
# to the other ranks as int32 (distributed/step_broadcast.py), so on a group a pool past 2**31 slots is
# one the decoder cannot address. A decoder of one rank broadcasts nothing (its slots are int64) and
# could address more, but the limit is the same for every world size by choice: a flag valid on one
# rank stays valid on several. --num-kv-blocks 10**12 set up a BlockManager of 10**12 blocks (a Python
# object each) before its pool was asked for at all.
MAX_KV_SLOTS = 2**31
# --block-size at most: two blocks (the reserved null block and one to hold positions) within
# MAX_KV_SLOTS, so that the most blocks a pool may hold is a pool at all and every limit derived from it
# (--num-kv-blocks', --kv-cache-bytes') is a positive count. --block-size 2**32 said "--num-kv-blocks
# must be at most 0", and 3 * 10**9 a negative --kv-cache-bytes. Far past any block worth having, but
# no tighter bound follows from the decoder itself, so none is imposed.
MAX_BLOCK_SIZE = MAX_KV_SLOTS // 2
# --world-size at most on an SPMD device (neuron): the most NeuronCores one instance has (trn2.48xlarge:
# 16 Trainium2 chips of 8). On XLA's CPU device each is a virtual device holding its share of the model
# and the KV pool (backends/xla/host_pool.py checks the pool's copies against the host's memory);
# --world-size 100000 asked the runtime for as many, and the host ran out of memory.
MAX_NUM_DEVICES = 128
# --world-size at most as ranks (processes, spawned on this host unless under torchrun): each rank holds
# whole attention heads (tensor_parallel.check_shardable divides num_heads and num_kv_heads by it), and
# no checkpoint of the families served has more than 128 query heads (Llama 3.1 405B's; its KV heads
# are 8). Past it the refusal was about divisibility: 2**63 said "num_heads (4) must be divisible by
# the world size (9223372036854775808)", as if a larger model could take it. Equal to MAX_NUM_DEVICES
# by coincidence, not by rule.
MAX_WORLD_SIZE = 128
# --collective-timeout-s at most: a collective (or a rank's exit) waited for longer than a day is a
# group that hangs, not one that is slow; far past it torch's timedelta overflows (NaN: a traceback).
MAX_COLLECTIVE_TIMEOUT_S = 86_400.0
# What the C kernels compute in, by name: a quantized linear has no torch path to fall back on.
KERNEL_DTYPE_NAMES = tuple(sorted(BY_TORCH[dtype].name for dtype in DTYPE_CODES))


def max_num_threads() -> int:
    """--num-threads at most (each rank's): the CPUs this process may run on, its affinity mask where
    the system has one (Linux), else the host's logical CPUs. Intra-op threads past them only take
    turns on the same CPUs (torch's own default is the physical cores), and far past them the host ran
    out: --num-threads 100,000 starved it of processes and the decoder died of SIGSEGV 10 s after it
    listened; 2**31 failed torch.set_num_threads in the engine thread's initializer (a traceback, exit
    1). The mask, not os.cpu_count(): under `taskset -c 0` on a 2-CPU host the host's count let 2
    threads take turns on one CPU. Not a fixed cap, so that a flag valid here may use every CPU here."""
    return available_cpus()


def default_num_threads(cpu_max: Path) -> int | None:
    """--num-threads left out: a container's CPU quota (cgroup v2 `cpu_max`) rounded up, where that is
    below both the CPUs this process may run on and torch's own default; else None, torch's default
    (the physical cores, or OMP_NUM_THREADS where set). Torch counts the host's cores, not the quota:
    two threads on a one-CPU quota take turns on one CPU's time and are throttled each period, so the
    quota rounded up, as Go 1.25's GOMAXPROCS and the JVM take it. Never above torch's default, so an
    OMP_NUM_THREADS=1 stays 1. A --num-threads given is bounded by the affinity mask, not the quota."""
    quota = quota_cpus(cpu_max)
    if quota is None or quota >= available_cpus():
        return None
    return quota if quota < torch.get_num_threads() else None


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; no transport settings."""

    model_dir: Path  # a Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
    dtype: str = "bfloat16"  # compute and KV-cache dtype, one of COMPUTE_NAMES.
    device: str = "cpu"  # "cpu", "cuda", "cuda:N" or "neuron" (backends/backend.py); checked, not imported.
    # "gguf": the linears and the token table served as the GGUF file `quantized_from` stores them
    # (models/gguf_weights.py); "int8" / "int4": rounded from model_dir's weights at load, int8 with
    # one scale per output channel, int4 with a scale and an offset per `quantization_group_size`
    # inputs (common/torch_part/quantized_tensor.py); "none": model_dir's dense weights. Activations
    # stay `dtype`.
    quantization: str = "none"
    quantized_from: Path | None = None
    quantization_group_size: int = QUANTIZATION_BLOCK  # int4 only: a multiple of 32
    # Quantized linears' inputs: "none" in `dtype` (exact sums; prefill chunks through the weights'
    # bf16 rounding); "int8" rounds every row's inputs to int8 per block of 32 and multiplies them as
    # integers (backends/cpu/csrc/linear_int8.c): faster at every row count, and lossy
    # (docs/PERFORMANCE.md has its fidelity). A row's bits still never depend on the rows beside it,
    # so speculation and batching stay exact within the mode.
    quantized_activations: str = "none"
    max_num_seqs: int = 64  # most requests in one step's batch.
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes).
    max_model_len: int | None = None  # context cap; None = the checkpoint's max_position_embeddings.
    # Waiting requests beyond this are refused (RESOURCE_EXHAUSTED); those paused for their readers are
    # not counted (NUM_SPARE_CALLS' comment says what bounds them).
    max_queue: int = 1024
    # Structured output: the CPU time, in ms, a request's grammar work per token (a mask, and taking or
    # checking the token after it) may cost on average over its last few masks before the request fails
    # (engine/sampling/structured.py's NOTE). It bounds what one request adds to every step of its
    # batch. With SmolLM2's vocabulary legitimate grammars stay far below 50: 6,000 tokens of nested
    # JSON objects 0.3 ms at most, the deepest 64 KiB Lark chain 2.5 ms, a right-recursive rule 25 ms
    # at the 1,997 tokens where llguidance's row limit stops it. CPU time, not wall time, so a busy
    # machine fails no request for its neighbours' load.
    max_grammar_cpu_ms_per_token: float = 50.0
    # Structured output: the CPU time, in ms, all of one step's grammar work (every constrained
    # request's masks, and taking its tokens) may cost before the dearest of those requests fail,
    # RESOURCE_EXHAUSTED, until the rest fit (engine/step/grammar_budget.py). The per-token limit
    # bounds one request, not many: 16 just under it cost 700 ms a step with SmolLM2's vocabulary.
    # Only requests heavy in themselves fail for it (over grammar_budget.heavy_mask_seconds a mask: 20 ms,
    # or half the per-token limit where that is less).
    max_grammar_cpu_ms_per_step: float = 250.0
    block_size: int = 16  # positions per KV block.
    kv_cache_bytes: int = 512 * 1024 * 1024  # KV pool size; the block count is derived from it.
    num_kv_blocks: int | None = None  # exact block count instead of kv_cache_bytes (tests).
    enable_prefix_caching: bool = True  # reuse full KV blocks of identical prompt prefixes.
    enable_prompt_embeds: bool = True  # accept embedding segments; off -> FAILED_PRECONDITION.
    static_shapes: bool = False  # pad batches to buckets so every step has a known input signature.
    token_buckets: tuple[int, ...] = ()  # static mode: padded token counts; () = powers of two.
    seq_buckets: tuple[int, ...] = ()  # static mode: padded sequence counts; () = powers of two.
    # static mode: padded block-table widths of decode steps, in blocks; () = fourfold steps up to
    # the blocks of max_model_len. Gathering decode paths cost what the width holds, not the context.
    block_table_buckets: tuple[int, ...] = ()
    compile: bool = False  # static mode: decode buckets are graphs compiled at warmup (Neuron: every step).
    # neuron: XLA devices the model spans, as one SPMD program in this process (DecoderConfig.world_size:
    # the options say its refusals as --world-size's).
    num_devices: int = 1
    # CPU, eager: steps run through the CPU executor and its C kernels (backends/cpu/, built when the
    # project is installed, chosen from the CPU's flags); False runs the plain model on torch ops.
    native_kernels: bool = True
    # CPU kernels: "auto" times each candidate on the model's shapes at load and binds the fastest
    # (backends/cpu/kernel_choice.py, cached beside the model); a build's name runs that build's
    # kernel for every linear.
    cpu_kernels: str = AUTO_KERNELS
    # torch intra-op threads; None = default_num_threads (a container's CPU quota, rounded up, where
    # lower than the CPUs and torch's default), else torch's default: an int or None once built.
    num_threads: int | None = None
    # A request's tokens do not depend on what else runs: each request's forward pass runs alone, its
    # prefill chunks start where they would alone, and prefix caching is off. Costs a batched step's
    # speed (one pass per request); see the proto's SamplingParams.seed.
    batch_invariant: bool = False
    # Speculative decoding by prompt lookup: tokens a decode step may propose and verify, for requests
    # that do not say (GenerateRequest.speculative_tokens); 0 = off. See engine/step/core.py.
    speculative_tokens: int = 0
    # Steps with more running requests than this verify no proposals. Where a step's cost grows with
    # its rows (computing rather than reading weights: a few rows on a CPU without bf16 FMAs), a
    # verified row is worth it only if every proposed token is accepted, so speculation pays only in
    # small batches. docs/PERFORMANCE.md has the measurement behind the default.
    speculative_max_batch: int = 4
    # Most requests in one step while a light caller (nothing waiting, at most this many running)
    # shares the batch with heavy ones (requests waiting, or more running: a flood beside a
    # neighbour): the neighbour's requests run every step, the flood's take turns for the rest, so
    # the neighbour's tokens come at the pace of a narrow step.
    # 0 = off; None = the backend's (8 on a CPU, where a step's time grows with its rows; off
    # elsewhere). See SchedulerConfig.shared_step_seqs and docs/RELIABILITY.md.
    shared_step_seqs: int | None = None
    # While a decoding request shares a step, each prefilling request's chunk takes at most this many
    # positions less the step's decode rows, never under half of it (vLLM's
    # --long-prefill-token-threshold caps at it alone); a prefill with no decode beside it
    # still takes the whole max_num_batched_tokens. A step's time grows with its positions (SmolLM2 on
    # 2 Zen 4 cores: 1-5 ms each), and every decoding request waits for the whole step. 0 = off; off
    # under batch_invariant, whose chunks never depend on their neighbours. docs/PERFORMANCE.md has the
    # measurement behind the default.
    long_prefill_token_threshold: int = 512
    # LoRA adapters, as vLLM's --enable-lora: `max_loras` slots of rank up to `max_lora_rank`, filled
    # at start from `loras` ((name, PEFT directory) pairs) and at run time (the LoadAdapter RPC). Each
    # request names its adapter or none, and requests of every adapter share one batch (the CPU
    # executor adds the deltas inside its fused layers: backends/cpu/lora.py).
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    loras: tuple[tuple[str, Path], ...] = ()
    # The directory LoadAdapter paths are taken in (models/adapter_root.py); None: LoadAdapter is refused
    # and only `loras` are served, as vLLM loads none at run time unless told to. A caller's path is
    # never opened outside it, and adapters are reported by their path relative to it.
    lora_root: Path | None = None

    @property
    def max_rows_without_prompt(self) -> int:
        """The most rows a step with no prompt positions holds: a row per running request, or, in a
        step that verifies proposals (at most speculative_max_batch requests), each request's row and
        its proposals. Larger steps are prefills (the CPU executor's dense quantized path)."""
        return max(self.max_num_seqs, self.speculative_max_batch * (1 + MAX_SPECULATIVE_TOKENS))

    @property
    def max_kv_blocks(self) -> int:
        """The most KV blocks of block_size positions a pool may hold (MAX_KV_SLOTS says why)."""
        return MAX_KV_SLOTS // self.block_size

    @property
    def kernel_options(self) -> KernelOptions:
        """How the CPU executor chooses its kernels (backends/cpu/kernel_choice.py)."""
        return KernelOptions(
            kernels=self.cpu_kernels,
            exact_rows=self.max_rows_without_prompt,
            max_rows=self.max_num_batched_tokens,
            prefill_kernels=not self.batch_invariant,
            cache_dir=Path(self.model_dir),
            int8_activations=self.quantized_activations == "int8",
        )

    def __post_init__(self) -> None:
        if self.dtype not in COMPUTE_NAMES:
            raise ConfigError("dtype", f"must be one of {COMPUTE_NAMES}, got {self.dtype!r}")
        self._check_quantization()
        if self.cpu_kernels not in CPU_KERNELS:
            raise ConfigError("cpu_kernels", f"must be one of {CPU_KERNELS}, got {self.cpu_kernels!r}")
        backend = backends.resolve(self.device)
        if backend.requires_static_shapes and not (self.static_shapes and self.compile):
            raise ConfigError(
                "device",
                f"{backend.name} runs static shapes only: it needs static_shapes and compile "
                "(--static-shapes true --compile true)",
            )
        (backend.attention or PagedAttention).check_block_size(self.block_size)
        if self.compile and not self.static_shapes:
            raise ConfigError("compile", "needs static_shapes (--static-shapes true): one graph per bucket")
        if self.num_devices != 1 and not backend.is_spmd:
            raise ConfigError(
                "num_devices", f"must be 1 on {backend.name} (several ranks are processes: world_size)"
            )
        if self.num_devices > MAX_NUM_DEVICES:
            raise ConfigError(
                "num_devices",
                f"must be at most {MAX_NUM_DEVICES} (the most NeuronCores one instance has: trn2.48xlarge's "
                f"16 Trainium2 chips of 8), got {self.num_devices:,}",
            )
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_queue",
            "block_size",
            "kv_cache_bytes",
            "num_devices",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        for name, limit in (("max_queue", MAX_QUEUE_LIMIT), ("max_num_seqs", MAX_NUM_SEQS_LIMIT)):
            if getattr(self, name) > limit:
                raise ConfigError(
                    name,
                    f"must be at most {limit:,} (the server holds twice the streams waiting and running "
                    f"as calls, ~20 KB each), got {getattr(self, name):,}",
                )
        if self.block_size > MAX_BLOCK_SIZE:
            raise ConfigError(
                "block_size",
                f"must be at most {MAX_BLOCK_SIZE:,} (two blocks, the reserved one and one to use, within "
                f"{MAX_KV_SLOTS:,} KV slots, int32's), got {self.block_size:,}",
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len", f"must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError(
                "num_kv_blocks", f"must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks > self.max_kv_blocks:
            raise ConfigError(
                "num_kv_blocks",
                f"must be at most {self.max_kv_blocks:,} ({MAX_KV_SLOTS:,} KV slots, int32's, of "
                f"--block-size {self.block_size}), got {self.num_kv_blocks:,}",
            )
        if not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                "speculative_tokens",
                f"must be in [0, {MAX_SPECULATIVE_TOKENS}], got {self.speculative_tokens}",
            )
        if self.shared_step_seqs is not None and self.shared_step_seqs < 0:
            raise ConfigError("shared_step_seqs", f"must be >= 0 (0: off), got {self.shared_step_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(
                "long_prefill_token_threshold",
                f"must be >= 0 (0: off), got {self.long_prefill_token_threshold}",
            )
        # NaN and inf too: they would fail no grammar, switching the limit off.
        if not 0 < self.max_grammar_cpu_ms_per_token < math.inf:
            raise ConfigError(
                "max_grammar_cpu_ms_per_token",
                f"must be > 0 and finite, got {self.max_grammar_cpu_ms_per_token}",
            )
        if not 0 < self.max_grammar_cpu_ms_per_step < math.inf:
            raise ConfigError(
                "max_grammar_cpu_ms_per_step",
                f"must be > 0 and finite, got {self.max_grammar_cpu_ms_per_step}",
            )
        if self.speculative_max_batch < 1:
            raise ConfigError("speculative_max_batch", f"must be >= 1, got {self.speculative_max_batch}")
        if self.num_threads is None:
            object.__setattr__(self, "num_threads", default_num_threads(CGROUP_CPU_MAX))  # frozen: once
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("num_threads", f"must be >= 1, got {self.num_threads}")
        if self.num_threads is not None and self.num_threads > max_num_threads():
            raise ConfigError(
                "num_threads",
                f"must be at most {max_num_threads():,} (the CPUs this process may run on: more threads "
                f"only take turns on them), got {self.num_threads:,}",
            )
        self._check_lora()
        for name in ("token_buckets", "seq_buckets", "block_table_buckets"):
            buckets = getattr(self, name)
            if list(buckets) != sorted(set(buckets)) or any(b < 1 for b in buckets):
                raise ConfigError(name, f"must be strictly increasing positive sizes, got {buckets}")
            # Eager steps have no buckets: given without static shapes they were ignored, silently.
            if buckets and not self.static_shapes:
                raise ConfigError(name, "is only used with --static-shapes true (eager steps are not padded)")

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if not 1 <= getattr(self, name) <= MAX_LORA_LIMITS[name]:
                raise ConfigError(name, f"must be in [1, {MAX_LORA_LIMITS[name]}], got {getattr(self, name)}")
        if not self.enable_lora:
            for name in ("loras", "lora_root"):
                if getattr(self, name):
                    raise ConfigError(name, "needs --enable-lora true")
            return
        if self.lora_root is not None and not self.lora_root.is_dir():
            why = "it is not a directory" if self.lora_root.exists() else "nothing is there"
            raise ConfigError("lora_root", f"must be a directory, got {str(self.lora_root)!r} ({why})")
        if self.lora_root is not None and self.lora_root.resolve() == Path("/"):
            # Every file of the server would be a LoadAdapter caller's to name.
            raise ConfigError(
                "lora_root",
                f"must be a directory that holds adapters only, got {str(self.lora_root)!r}, the file "
                "system's root",
            )
        if len(self.loras) > self.max_loras:
            raise ConfigError("loras", f": {len(self.loras)} adapters, more than max_loras {self.max_loras}")
        names = [name for name, _ in self.loras]
        for name in names:
            try:
                check_adapter_name(name)
            except InvalidArgument as error:
                raise ConfigError("loras", f": adapter name {name!r}: {error.description}") from None
            if names.count(name) > 1:
                raise ConfigError("loras", f": adapter name {name!r} is given twice")
        is_xla = backends.resolve(self.device).placement == "xla"
        needs = {
            "device": (
                self.device == "cpu" or is_xla,
                "cpu or an XLA device such as neuron (its graphs add every slot's delta), "
                f"got {self.device!r}",
            ),
            "compile": (
                not self.compile or is_xla,
                "off on the CPU (the compiled decode buckets take no adapters)",
            ),
        }
        for name, (ok, what) in needs.items():
            if not ok:
                raise ConfigError("enable_lora", f"needs --{name.replace('_', '-')} {what}")

    def _check_quantization(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError("quantization", f"must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        group = self.quantization_group_size
        if group < QUANTIZATION_BLOCK or group % QUANTIZATION_BLOCK != 0:
            raise ConfigError(
                "quantization_group_size", f"must be a positive multiple of {QUANTIZATION_BLOCK}, got {group}"
            )
        if group != QUANTIZATION_BLOCK and self.quantization != "int4":
            raise ConfigError(
                "quantization_group_size", f"is only used by --quantization int4, not {self.quantization!r}"
            )
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise ConfigError(
                "quantized_activations",
                f"must be one of {QUANTIZED_ACTIVATIONS}, got {self.quantized_activations!r}",
            )
        if self.quantization == "none":
            if self.quantized_activations != "none":
                raise ConfigError(
                    "quantized_activations",
                    f"{self.quantized_activations} needs --quantization gguf, int8 or int4 (it rounds the "
                    "inputs of quantized linears)",
                )
            return
        if backends.resolve(self.device).placement == "xla":
            # An XLA device dequantizes each weight inside the step's graph (models/quantized.py's
            # reference forward): no C kernels, any dtype, static shapes as every XLA graph; several
            # devices split the codes as the dense weights (backends/xla/sharding.py).
            if self.quantized_activations != "none":
                raise ConfigError(
                    "quantized_activations",
                    f"{self.quantized_activations} needs --device cpu (it rounds inputs in a CPU kernel), "
                    f"got {self.device!r}",
                )
            return
        needs = {
            "device": (
                self.device == "cpu",
                f"cpu or an XLA device such as neuron (the quantized kernels are CPU kernels), "
                f"got {self.device!r}",
            ),
            "dtype": (
                self.dtype in KERNEL_DTYPE_NAMES,
                f"{' or '.join(KERNEL_DTYPE_NAMES)}, got {self.dtype!r}",
            ),
            "native_kernels": (self.native_kernels, "on: the quantized linears are C kernels"),
            "static_shapes": (not self.static_shapes, "off (eager steps only)"),
        }
        for name, (ok, what) in needs.items():
            if not ok:
                raise ConfigError(
                    "quantization", f"{self.quantization} needs --{name.replace('_', '-')} {what}"
                )


# The most LoRA slots and the highest rank a server may reserve (each slot holds a rank-`max_lora_rank`
# copy of every projection's A and B: SmolLM2 at rank 16, 10 MB in bf16).
MAX_LORA_LIMITS = {"max_loras": 256, "max_lora_rank": 512}

# --quantization: "gguf" serves a GGUF file's own Q4_0 / Q4_1 / Q8_0 weights (others re-quantized once);
# "int8" and "int4" round a dense checkpoint's (common/torch_part/quantized_tensor.py's SCHEMES).
QUANTIZATIONS = ("none", "gguf", *SCHEMES)
# --quantized-activations: the quantized linears' inputs in --dtype, or rounded to int8 per 32.
QUANTIZED_ACTIVATIONS = ("none", "int8")


@dataclass(frozen=True)
class DecoderConfig:
    """The decoder service: its engine plus how it is served."""

    engine: EngineConfig
    server: ServerOptions = field(default_factory=lambda: ServerOptions(port=DEFAULT_PORT))
    model_name: str = ""  # name reported by GetModelInfo and in traces; "" = model directory name.
    world_size: int = 1  # ranks the model runs on.
    collective_timeout_s: float = 60.0  # several ranks: a collective or step broadcast waiting longer fails.
    # Open Generate streams one connection may hold (api/stream_limit.py). Half the default batch:
    # one caller can never occupy every running slot.
    max_streams_per_connection: int = 32
    # With bearer tokens on, open Generate streams one token may hold over all its connections (a
    # token is one caller, api/caller.py): more connections do not buy more memory or slots.
    max_streams_per_token: int = 256
    # Encoder parts (api/encoder_parts.py): the encoder the decoder fetches their rows from (host:port,
    # several separated by commas, balanced, or dns:///name:port); "" = none, and such parts are
    # refused. Its rows of recent inputs are kept up to this many bytes (0: none).
    encoder_address: str = ""
    encoder_cache_bytes: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.server.max_concurrent_rpcs < max_calls(self.engine):
            raise ConfigError(
                "max_queue",
                f"{self.engine.max_queue:,} waiting and {self.engine.max_num_seqs:,} running streams need "
                f"a server holding {max_calls(self.engine):,} calls at once (max_calls), which holds "
                f"{self.server.max_concurrent_rpcs:,} (max_concurrent_rpcs)",
            )
        check_served_name(self.model_name)  # one a request can name and a log line can hold, as the encoder's
        for name in ("max_streams_per_connection", "max_streams_per_token"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.encoder_cache_bytes < 0:
            raise ConfigError(
                "encoder_cache_bytes", f"must be >= 0 (0: none), got {self.encoder_cache_bytes}"
            )
        if self.encoder_address and not all(a.strip() for a in self.encoder_address.split(",")):
            raise ConfigError(
                "encoder_address",
                f"expected host:port, several separated by commas, got {self.encoder_address!r}",
            )
        if self.world_size < 1:
            raise ConfigError("world_size", f"must be >= 1, got {self.world_size}")
        if self.world_size > MAX_WORLD_SIZE:
            raise ConfigError(
                "world_size",
                f"must be at most {MAX_WORLD_SIZE} (each rank holds whole attention heads, and no checkpoint "
                f"of the families served has more than {MAX_WORLD_SIZE} query heads: Llama 3.1 405B's), "
                f"got {self.world_size:,}",
            )
        # NaN too: it passed a `<= 0` check, and timedelta refused it in a traceback once ranks started.
        if not 0 < self.collective_timeout_s <= MAX_COLLECTIVE_TIMEOUT_S:
            raise ConfigError(
                "collective_timeout_s",
                f"must be > 0 and at most {MAX_COLLECTIVE_TIMEOUT_S:,.0f} (a day), "
                f"got {self.collective_timeout_s}",
            )
        backend = backends.resolve(self.engine.device)
        if backend.is_spmd and self.engine.num_devices != self.world_size:
            raise ConfigError(
                "world_size",
                f"is {self.world_size} but the engine spans {self.engine.num_devices} {backend.name} devices",
            )
        if self.world_size > 1 and not backend.is_spmd:
            if backend.collective_backend is None:
                raise ConfigError(
                    "world_size",
                    f"must be 1: device {backend.name} runs on one rank only, got {self.world_size}",
                )
            if self.engine.compile:
                raise ConfigError(
                    "world_size", f"must be 1: compile runs on one rank only, got {self.world_size}"
                )
        for name, _ in self.engine.loras:
            if name == self.model_name:
                raise ConfigError("loras", f": adapter name {name!r} is the model's own name")


def max_calls(engine: EngineConfig) -> int:
    """The calls the decoder's server holds at once (its ServerOptions.max_concurrent_rpcs), so that
    the engine's own bounds answer first, naming their flags (RESOURCE_EXHAUSTED "waiting queue is
    full", with RetryInfo), where the server's bound names a number and no flag: the requests
    running (--max-num-seqs) and those waiting (--max-queue), and NUM_SPARE_CALLS more for every other
    call, requests paused for their readers among them (its comment), twice over, since health's Watch
    streams may take half of a server's places (tandem.common.health.max_watches). Never under every
    server's default."""
    return max(DEFAULT_MAX_CONCURRENT_RPCS, 2 * (engine.max_queue + engine.max_num_seqs + NUM_SPARE_CALLS))
