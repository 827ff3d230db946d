"""One XLA step against the CPU engine's: the same logits at every prefill position, and what crosses
between host and device (the KV cache never leaves the device)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.common.torch_part.prompt_parts import PromptPart
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.params import StoppingParams
from tandem.decoder.engine.step.batch import BatchTensors, HostBatch
from tandem.decoder.engine.step.xla_runner import XlaRunner, _pad_positions
from tests.xla.helpers import engine_on, greedy, prompts_of_each_kind, settings

LOGITS_TOLERANCE = 1e-4  # float32, the bound


def _prefill_host(engine: Engine, prompt: list[PromptPart]) -> HostBatch:
    """The prompt as one fresh sequence in blocks 1.., asking for the logits of every position."""
    request = engine.make_request(GenerateSpec(prompt, stopping=StoppingParams(max_new_tokens=1)))
    n, block_size = request.num_prompt_tokens, engine.config.block_size
    return HostBatch(
        input_ids=list(request.prompt_token_ids),
        positions=list(range(n)),
        slots=[block_size + p for p in range(n)],
        is_token_ids=list(request.is_token_ids),
        embed_pieces=[(span.start, span.rows) for span in request.embedding_spans],
        query_lens=[n],
        seq_lens=[n],
        block_tables=[tuple(range(1, 2 + (n - 1) // block_size))],
        logits_rows=[n - 1],
        num_logits=1,
        scored_rows=list(range(n)),
    )


def _cpu_logits(engine: Engine, host: HostBatch) -> torch.Tensor:
    """float32 [n, vocab]: the CPU engine's executor over the whole prompt."""
    config = engine.model_config
    tensors = BatchTensors(torch.device("cpu"), config.hidden_size, config.dtype)
    batch = tensors.batch(host, len(host.block_tables[0]), has_embeds=bool(host.embed_pieces))
    runner = engine.core.runner
    with torch.inference_mode():
        logits = runner.executor(batch.inputs, runner.kv_caches)
    return logits[1:]


def _xla_logits(engine: Engine, host: HostBatch) -> torch.Tensor:
    """float32 [n, vocab]: the XLA engine's prefill graph and LM-head graph over the whole prompt."""
    runner = engine.core.runner
    assert isinstance(runner, XlaRunner)
    bucket = runner.buckets.prefill(len(host.input_ids), host.seq_lens[0])
    _pad_positions(host, bucket.num_tokens)
    batch = runner.tensors.batch(host, bucket.width, has_embeds=True)
    with torch.no_grad():
        h = runner.step.hidden_states(batch.inputs, runner.kv_caches)
        return runner.step.compute_logits(h[1:])


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_every_prefill_position_has_the_cpu_engines_logits_for_each_prompt_kind(
    model: str, tiny_model_dir: Path, smollm2_dir: Path
) -> None:
    model_dir = tiny_model_dir if model == "tiny" else smollm2_dir
    # The one prefill graph the prompts run in (32 positions, a 2-block table) and the one decode graph
    # every engine has: warmup compiles nothing else (SmolLM2's 4 more buckets were 15 s on 2 cores).
    values = settings(
        model_dir,
        max_num_seqs=2,
        max_model_len=32,
        seq_buckets=(2,),
        token_buckets=(32,),
        block_table_buckets=(2,),
    )
    with engine_on("cpu", **values) as cpu, engine_on("neuron", **values) as xla:
        kinds = prompts_of_each_kind(model_dir, cpu.model_config.vocab_size, count=3)
        for kind, prompts in kinds.items():
            prompt = prompts[-1]  # 11 positions: a chunk padded to 32
            want = _cpu_logits(cpu, _prefill_host(cpu, prompt))
            got = _xla_logits(xla, _prefill_host(xla, prompt))
            assert got.shape == want.shape
            gap = (got - want).abs().max().item()
            assert gap <= LOGITS_TOLERANCE, f"{kind}: logits differ by {gap}"


def test_a_decode_step_sends_ids_positions_and_tables_and_brings_back_only_logits(
    tiny_model_dir: Path,
) -> None:
    values = settings(
        tiny_model_dir, max_num_seqs=2, seq_buckets=(2,), token_buckets=(8, 32), block_table_buckets=(2, 8)
    )
    with engine_on("neuron", **values) as xla:
        step = xla.core.runner.step
        before = (step.decode.num_steps, step.decode.bytes_to_device, step.decode.bytes_from_device)
        assert len(greedy(xla, [[5, 6, 7]], num_tokens=12)) == 12
        num_steps = step.decode.num_steps - before[0]
        assert num_steps == 11
        vocab = xla.model_config.vocab_size
        rows, width = 2, 2  # the decode bucket: 2 rows, a block table 2 blocks wide
        # Back: each row's float32 logits, nothing else (the KV cache stays on the device).
        assert step.decode.bytes_from_device - before[2] == num_steps * rows * vocab * 4
        # There: int32 IDs, int64 positions, int32 lengths, int64 slots, the int32 block table,
        # int64 logits rows and int32 query starts; no embedding rows and no weights.
        sent = rows * (4 + 8 + 4 + 8 + 8) + rows * width * 4 + (rows + 1) * 4
        assert step.decode.bytes_to_device - before[1] == num_steps * sent
