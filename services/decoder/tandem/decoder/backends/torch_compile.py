"""CPU and CUDA decode buckets: `torch.compile` with `dynamic=False`, one graph per bucket."""

from __future__ import annotations

import time
import types

import torch

from tandem.decoder.backends.backend import Backend, RecompileError, StepFn


def _inductor_mode_options(mode: str) -> dict[str, object]:
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def _call_model(model: torch.nn.Module, *args: object) -> torch.Tensor:
    return model(*args)


class TorchCompileBuckets:
    """CPU and CUDA: `torch.compile(model, dynamic=False, fullgraph=True)`, one graph per bucket.

    Dynamo keeps one cache entry per input signature of the compiled function, so one compiled
    callable serves every bucket; `num_graphs` counts what the backend compiled. Dynamo's cache
    hangs off a code object, so each instance compiles a private copy of `_call_model`: two
    runners (or two engines in one test session) never share entries or a recompile limit. After
    `seal()` (warmup done) any further compile raises instead of silently stalling a step: the call
    runs under `fail_on_recompile`, and the counting backend refuses too.
    """

    def __init__(
        self,
        backend: Backend,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],  # per layer; written in place by every step
        max_num_buckets: int,
    ) -> None:
        self.mode = backend.compile_mode or "default"
        self.compile_backend = backend.compiler
        self.inductor_options = _inductor_mode_options(self.mode)
        self.max_num_buckets = max_num_buckets
        self.num_graphs = 0  # graphs compiled so far (one per bucket when fullgraph holds)
        self.compile_s = 0.0  # seconds spent inside the compiler backend
        self.num_calls = 0  # steps run through the compiled graphs, warmup included
        self.is_sealed = False
        self.copies_output = backend.uses_cuda_graphs
        for cache in kv_caches:  # CUDA graphs may then mutate them in place; a no-op elsewhere
            torch._dynamo.mark_static_address(cache)
        step = types.FunctionType(_call_model.__code__.replace(), _call_model.__globals__, "decode_step")
        self.model = model
        self.compiled = torch.compile(step, backend=self._compile_graph, dynamic=False, fullgraph=True)

    def bucket(self) -> StepFn:
        """The step function of one more decode bucket (compiled on its first call, at warmup)."""
        return self._run

    def seal(self) -> None:
        self.is_sealed = True

    def _run(self, *args: object) -> torch.Tensor:
        self.num_calls += 1
        if self.is_sealed:
            with torch.compiler.set_stance("fail_on_recompile"):
                out = self.compiled(self.model, *args)
        else:
            # Every bucket is a new cache entry of the same code object: lift dynamo's default limit.
            limit = max(torch._dynamo.config.recompile_limit, self.max_num_buckets)
            with torch._dynamo.config.patch(recompile_limit=limit):
                out = self.compiled(self.model, *args)
        return out.clone() if self.copies_output else out

    def _compile_graph(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        if self.is_sealed:
            raise RecompileError("a compiled decode bucket recompiled after warmup")
        start = time.perf_counter()
        if self.compile_backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            compiled = compile_fx(gm, example_inputs, config_patches=self.inductor_options)
        else:
            compiled = torch._dynamo.lookup_backend(self.compile_backend)(gm, example_inputs)
        self.num_graphs += 1
        self.compile_s += time.perf_counter() - start
        return compiled
