"""Each benchmark subject (Tandem's engine, transformers) in a process of its own.

A process that runs parallel torch ops on two threads keeps two OpenMP teams, and on this 2-core
machine the second team slows the first one's ops by ~50% (docs/PERFORMANCE.md). So no subject
shares a process with another, nor with the harness's own torch work (floors, tables): each lives
in a spawned child, driven over a pipe, and idles (no CPU) while another is measured.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch


class Remote:
    """Calls methods of an object built in a child process; results come back pickled."""

    def __init__(self, factory: type, *args: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, factory, args), daemon=True)
        self._process.start()
        self._result()  # construction finished (or raised)

    def call(self, method: str, *args: Any) -> Any:
        self._conn.send((method, args))
        return self._result()

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(None)
            self._process.join(timeout=120)

    def _result(self) -> Any:
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"benchmark subject failed: {value}")
        return value


def _serve(conn: Connection, factory: type, args: tuple[Any, ...]) -> None:
    try:
        subject = factory(*args)
        conn.send(("ok", None))
    except Exception as error:
        conn.send(("error", repr(error)))
        return
    while (message := conn.recv()) is not None:
        method, call_args = message
        try:
            conn.send(("ok", getattr(subject, method)(*call_args)))
        except Exception as error:
            conn.send(("error", repr(error)))
    close = getattr(subject, "close", None)
    if close is not None:
        close()


class TandemSubject:
    """Tandem's in-process Engine (the engine loads and steps on its own thread)."""

    def __init__(
        self,
        model_dir: Path,
        workload: argparse.Namespace,
        max_requests: int,
        enable_prefix_caching: bool,
        quantized_from: Path | None = None,  # the GGUF file: serve its own quantized weights
        quantized_activations: str = "none",  # with quantized_from: --quantized-activations
    ) -> None:
        from decode_throughput import build_engine

        # The harness thread here only submits: one intra-op thread, so it holds no OpenMP team.
        self.engine = build_engine(
            model_dir, workload, max_requests, enable_prefix_caching=enable_prefix_caching,
            quantized_from=quantized_from, quantized_activations=quantized_activations,
        )  # fmt: skip
        torch.set_num_threads(1)
        self.table: torch.Tensor | None = None
        self.model_dir = model_dir

    @staticmethod
    def rss_mb() -> float:
        """This process's resident memory, MB (the engine, its model and its KV cache)."""
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024

    def info(self) -> dict[str, int]:
        c = self.engine.model_config
        params = sum(p.numel() for p in self.engine.loaded.model.parameters())
        return dict(params=params, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                    num_heads=c.num_heads, head_dim=c.head_dim, num_layers=c.num_layers)  # fmt: skip

    def run(
        self, prompts: list[list[int]], new_tokens: int, embeds: bool
    ) -> tuple[int, float, float, float | None]:
        """(generated tokens, wall seconds, median TTFT seconds, decode-only seconds)."""
        from decode_throughput import run_tandem

        from tandem.decoder.engine.admission.prompt import EmbeddingPrompt

        if embeds:
            table = self._table()
            inputs = [EmbeddingPrompt(table[torch.tensor(p)]) for p in prompts]
            result, _ = run_tandem(self.engine, inputs, new_tokens)
        else:
            result, _ = run_tandem(self.engine, prompts, new_tokens)
        return result.tokens, result.wall_s, result.ttft_median_s, result.decode_s

    def _table(self) -> torch.Tensor:
        if self.table is None:
            from tandem.encoder.lookup import read_embedding_table

            self.table = read_embedding_table(self.model_dir).to(torch.bfloat16)  # [vocab, hidden]
        return self.table

    def close(self) -> None:
        self.engine.shutdown()


class TransformersSubject:
    """Hugging Face `generate` on the same checkpoint, in `dtype` (the harness picks the faster here)."""

    def __init__(self, model_dir: Path, threads: int, dtype: str) -> None:
        from decode_throughput import load_transformers

        torch.set_num_threads(threads)
        self.model = load_transformers(model_dir, getattr(torch, dtype))

    def run(
        self, prompts: list[list[int]], new_tokens: int, embeds: bool
    ) -> tuple[int, float, float, float | None]:
        """(generated tokens, wall seconds, TTFT seconds, decode-only seconds)."""
        from decode_throughput import _FirstCallTimer, run_transformers
        from transformers import LogitsProcessorList

        if not embeds:
            result, _ = run_transformers(self.model, prompts, new_tokens)
            return result.tokens, result.wall_s, result.ttft_median_s, result.decode_s
        embeddings = self.model.get_input_embeddings().weight[torch.tensor(prompts)]  # [N, len, hidden]
        timer = _FirstCallTimer()
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(
                inputs_embeds=embeddings,
                attention_mask=torch.ones(embeddings.shape[:2], dtype=torch.long),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([timer]),
            )
            wall = time.perf_counter() - start
        if out.shape[-1] != new_tokens:  # with inputs_embeds only, generate returns just the new tokens
            raise RuntimeError(f"transformers generated shape {tuple(out.shape)}, expected [N, {new_tokens}]")
        ttft = (timer.first or start) - start
        return len(prompts) * new_tokens, wall, ttft, wall - ttft
