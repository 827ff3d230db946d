"""The OpenAI SDK selects a LoRA adapter by `model`, as with vLLM, and /v1/models lists the adapters."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from services.decoder.tests.lora_adapters import SPECS, make_adapter
from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.config import GatewayConfig
from tests.integration.decoder.conftest import Served, serve, shutdown
from tests.integration.gateway.conftest import start_gateway, stop_gateway

pytestmark = pytest.mark.asyncio
PROMPT = "Once upon a time"


@pytest.fixture
async def gateway(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[tuple[str, Served]]:
    adapter = make_adapter(tiny_model_dir, tmp_path / "qv4", SPECS["qv4"], seed=0)
    decoder = await serve(tiny_model_dir, None, enable_lora=True, loras=(("qv4", adapter),))
    # The encoder is never called here: an address nothing listens on.
    config = GatewayConfig(decoder_address=decoder.server.address, encoder_address="127.0.0.1:9", port=0)
    task, port = await start_gateway(config)
    try:
        yield f"http://127.0.0.1:{port}/v1", decoder
    finally:
        await stop_gateway(task)
        await shutdown(decoder)


async def grpc_reply(decoder: Served, adapter: str) -> str:
    request = decoder_pb2.GenerateRequest(adapter=adapter)
    request.stopping.max_new_tokens = 12
    request.sampling.temperature = 0
    request.chat.messages.add(role="user").content.add(text=PROMPT)
    return (await decoder.client._collect(decoder.client.generate(request)))[0]


async def test_the_sdk_chats_with_an_adapter_by_model_name_and_lists_it(
    gateway: tuple[str, Served],
) -> None:
    base_url, decoder = gateway
    base = (await decoder.client.model_info()).model
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        models = await client.models.list()
        replies = {}
        for model in (base, "qv4"):
            reply = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0
            )
            assert reply.model == model
            replies[model] = reply.choices[0].message.content
        with pytest.raises(openai.NotFoundError, match="model 'other' is not loaded") as unknown:
            await client.chat.completions.create(
                model="other", messages=[{"role": "user", "content": PROMPT}], max_tokens=2
            )
        assert (await client.models.retrieve("qv4")).parent == base  # type: ignore[attr-defined]
    assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
    assert [m.id for m in models.data] == [base, "qv4"]
    assert replies["qv4"] == await grpc_reply(decoder, "qv4") != replies[base]
    assert replies[base] == await grpc_reply(decoder, "")
