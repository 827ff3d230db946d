"""Real decoders under one --model-name behind the gateway: over two checkpoints of one shape (the same
config, tokenizer and sizes, other weights) the gateway treats one as another model, which their names
and shapes alone could not tell; decoders of one checkpoint agree and serve."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

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


async def test_of_decoders_under_one_name_the_one_of_another_checkpoint_of_that_shape_is_another_model(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, tmp_path: Path
) -> None:
    other_dir = make_model(tmp_path / "other-weights", shape="tiny-random", seed=1)  # another seed
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
