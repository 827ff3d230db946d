"""bench/decode_throughput.py's engines, and grpc_throughput's server built from the same numbers: what
the documented bench runs ask of the decoder is accepted, with the step budget they ask for wherever
their KV pool holds it."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.step import sizing

BENCH = Path(__file__).resolve().parents[2] / "bench"


@functools.cache
def _bench(name: str) -> ModuleType:  # scripts, not a package: loaded from their files, once
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # grpc_throughput imports decode_throughput as the scripts do
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class _Unstarted:
    """Stands in for Engine: keeps the config, starts nothing (no model is read)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config


def _workload(prompt_len: int, new_tokens: int, budget: int = 4096) -> argparse.Namespace:
    return argparse.Namespace(
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        threads=1,
        max_num_batched_tokens=budget,
        stream_interval=1,
    )


def _config(monkeypatch: pytest.MonkeyPatch, args: argparse.Namespace, max_requests: int) -> EngineConfig:
    bench = _bench("decode_throughput")
    monkeypatch.setattr(bench, "Engine", _Unstarted)
    return bench.build_engine(Path("/nonexistent"), args, max_requests, start=False).config


# (prompt_len, new_tokens, most requests) of each run bench/README.md, RELIABILITY.md and
# PERFORMANCE-HISTORY.md give; each pool of 1 and 8 requests holds under 4,096 positions.
DOCUMENTED_RUNS = {
    "decode_throughput.py (--sizes 1,8,32)": (128, 64, 32),
    "decode_throughput.py --sizes 1,8": (128, 64, 8),
    "harness.py --quick, decode (sizes 1,8)": (128, 64, 8),
    "harness.py --quick, TTFT (a 1,024 prefix, 1 request)": (1024, 1, 1),
    "harness.py, TTFT (4,095, 1 request)": (4095, 1, 1),
    "profile_step.py --sizes 1,8 --prompt-len 300": (300, 3 * 16 + 8, 8),
    "profile_step.py --sizes 1": (128, 3 * 16 + 8, 1),
    "structured_steps.py (--sizes 8,32)": (64, 16 + 8, 32),
    "structured_steps.py --sizes 8": (64, 16 + 8, 8),
}


@pytest.mark.parametrize("run", DOCUMENTED_RUNS)
def test_documented_runs_are_accepted_by_the_decoders_budget_check(
    monkeypatch: pytest.MonkeyPatch, run: str
) -> None:
    """b6bf235a refused the 4,096 budget beside pools of fewer positions: 7 of these runs."""
    prompt_len, new_tokens, max_requests = DOCUMENTED_RUNS[run]
    config = _config(monkeypatch, _workload(prompt_len, new_tokens), max_requests)
    sizing.check_token_budget(config, config.num_kv_blocks)


def test_the_budget_asked_is_kept_where_the_pool_holds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """32 requests of 192 positions: 392 blocks of 16 beside the reserved one hold 6,272 positions."""
    assert _config(monkeypatch, _workload(128, 64), 32).max_num_batched_tokens == 4096


def test_a_budget_past_the_pool_is_cut_to_its_positions_never_under_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step never computes more positions than the pool holds, so the cut changes no step."""
    held = _config(monkeypatch, _workload(300, 56), 8)  # 8 x 23 + 9 blocks: 192 x 16 positions
    assert (held.num_kv_blocks, held.max_num_batched_tokens) == (193, 3072)
    small = _config(monkeypatch, _workload(128, 64), 1)  # 21 blocks: the default 2,048 is kept
    assert small.max_num_batched_tokens == sizing.DEFAULT_TOKEN_BUDGET


def test_a_budget_is_at_least_one_token_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(monkeypatch, _workload(128, 64, budget=1), 32)
    assert config.max_num_batched_tokens == 32


def test_the_grpc_server_gets_the_in_process_engines_pool_and_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """grpc_throughput compares the two: its server's flags carry the same numbers."""
    grpc_bench = _bench("grpc_throughput")
    argv: list[str] = []
    monkeypatch.setattr(grpc_bench.subprocess, "Popen", lambda args, **_: argv.extend(args))
    args = _workload(128, 64)
    grpc_bench.start_server(Path("/nonexistent"), args, 8)
    flags = dict(zip(argv[3::2], argv[4::2], strict=True))
    config = _config(monkeypatch, args, 8)
    assert int(flags["--num-kv-blocks"]) == config.num_kv_blocks == 105
    assert int(flags["--max-num-batched-tokens"]) == config.max_num_batched_tokens == 2048


def test_the_breakdowns_step_timer_wraps_what_the_engine_runs_and_times_every_phase(
    tiny_model_dir: Path,
) -> None:
    """`--breakdown` (and bench/profile_step.py) wrap the engine's own methods by name: when the step
    loses one (core._emit became _outputs and _deliver) or a signature changes (schedule's
    not_runnable), the bench failed with AttributeError or a failed request, and no test saw it."""
    bench = _bench("decode_throughput")
    args = _workload(prompt_len=8, new_tokens=4)
    with bench.build_engine(tiny_model_dir, args, max_requests=2) as engine:
        timer = bench.StepTimer(engine)
        try:
            prompts = bench.make_prompts(2, 8, engine.model_config.vocab_size, seed=0)
            _, tokens = bench.run_tandem(engine, prompts, 4)
        finally:
            timer.restore()
    assert [len(t) for t in tokens] == [4, 4]
    summary = timer.summary()
    assert summary and all(row["steps"] >= 1 for row in summary.values())
    assert all(row[phase] > 0 for row in summary.values() for phase in ("forward", "sample", "emit"))
