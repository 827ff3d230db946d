"""Real decoders under one --model-name behind the gateway: over two checkpoints of one shape (the same
config, tokenizer and sizes, other weights; or a tune that kept the token table) the gateway treats one
as another model, which their names and shapes alone could not tell; decoders of one checkpoint agree
and serve."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.common.torch_part.random_model import make_model
from tandem.decoder.models.loader import LoadedModel, load_model
from tandem.gateway.callers import decoder_channels
from tandem.gateway.config import GatewayConfig
from tests.integration.decoder.conftest import Served, serve, shutdown

NAME = "tiny"  # the one name every decoder serves under


async def _eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def _address(served: Served) -> str:
    return f"127.0.0.1:{served.server.port}"


def _kept_table_tune(model_dir: Path, out_dir: Path) -> Path:
    """`model_dir` with every layer weight moved and its token table and norms kept: what a fine-tune
    that froze its embeddings, or a merged LoRA, looks like (the reviewer's case: all three served)."""
    shutil.copytree(model_dir, out_dir)
    weights = load_file(out_dir / "model.safetensors")
    noise = torch.Generator().manual_seed(7)
    for name, value in weights.items():
        if "embed_tokens" not in name and "norm" not in name:
            weights[name] = value + 0.05 * torch.randn(value.shape, generator=noise, dtype=value.dtype)
    save_file(weights, out_dir / "model.safetensors")
    return out_dir


@pytest.mark.parametrize("other", ["another-seed", "kept-table-tune"])
async def test_of_decoders_under_one_name_the_one_of_another_checkpoint_of_that_shape_is_another_model(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path, other: str
) -> None:
    if other == "another-seed":
        other_dir = make_model(tmp_path / other, shape="tiny-random", seed=1)
    else:
        other_dir = _kept_table_tune(tiny_model_dir, tmp_path / other)
    checkpoints = [(tiny_model_dir, tiny_fp32), (other_dir, load_model(other_dir, dtype="float32"))]
    started: list[Served] = []
    try:
        for model_dir, loaded in (checkpoints[0], checkpoints[1], checkpoints[0]):
            started.append(await serve(model_dir, loaded, model_name=NAME, num_kv_blocks=64))
        infos = [await served.client.model_info() for served in started]
        assert len({(info.model, info.hidden_size, info.vocab_size) for info in infos}) == 1
        first, other, second = (_address(served) for served in started)
        channels = decoder_channels(GatewayConfig(decoder_address=f"{first},{other},{second}"))
        try:
            replicas = channels.replicas
            assert replicas is not None
            await _eventually(lambda: len(replicas.serving) == 2 and bool(replicas.mismatched))
            assert replicas.serving == (first, second) and replicas.model == NAME
            assert list(replicas.mismatched) == [other]
        finally:
            await channels.close()
    finally:
        await asyncio.gather(*(shutdown(served) for served in started))
