"""LoRA adapters over gRPC on the default model's architecture (a tiny random Llama, float32): three
peft adapters of different ranks and targets and the base model in one running batch, each with
transformers + peft's own tokens; with embedding prompts and speculation; loaded, unloaded and
reloaded while another adapter's stream runs; and every refusal with its status."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from services.decoder.tests.lora_adapters import SPECS, make_adapter, peft_greedy
from tandem.client.pb.tandem.v1 import decoder_pb2, tensor_pb2
from tandem.common.model_name import echo
from tandem.common.torch_part.random_model import make_model

from .conftest import Served, serve, shutdown

pytestmark = pytest.mark.asyncio
PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12, 17, 402, 33]
NUM_TOKENS = 32
LONG = 320  # the stream that runs while adapters come and go (the calls beside it take ~100 of its steps)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """The model and its adapters, side by side in one directory: the decoders' --lora-root."""
    root = tmp_path_factory.mktemp("lora")
    model_dir = make_model(root / "tiny-llama", shape="tiny-llama", seed=0)
    adapters = {
        name: make_adapter(model_dir, root / name, spec, seed=i)
        for i, (name, spec) in enumerate(SPECS.items())
    }
    return model_dir, adapters


@pytest.fixture(scope="module")
def references(llama: tuple[Path, dict[str, Path]]) -> dict[str, list[int]]:
    """transformers + peft's greedy tokens per adapter ("" = the base model)."""
    model_dir, adapters = llama
    tokens = {"": peft_greedy(model_dir, None, PROMPT, NUM_TOKENS)}
    for name, path in adapters.items():
        tokens[name] = peft_greedy(model_dir, path, PROMPT, NUM_TOKENS)
    assert len({tuple(t) for t in tokens.values()}) == 4  # every adapter changes the answer
    return tokens


@pytest.fixture
async def lora_decoder(llama: tuple[Path, dict[str, Path]]) -> AsyncIterator[Served]:
    model_dir, adapters = llama
    served = await serve(
        model_dir,
        None,
        enable_lora=True,
        loras=tuple(adapters.items()),
        max_loras=4,
        max_lora_rank=16,
        lora_root=model_dir.parent,
    )
    yield served
    await shutdown(served)


def request(
    adapter: str, prompt=None, max_new_tokens: int = NUM_TOKENS, **fields
) -> decoder_pb2.GenerateRequest:
    message = decoder_pb2.GenerateRequest(adapter=adapter, **fields)
    if prompt is None:
        message.prompt.add().token_ids.ids.extend(PROMPT)
    else:
        message.prompt.append(prompt)
    message.sampling.temperature = 0
    message.stopping.max_new_tokens = max_new_tokens
    message.stopping.ignore_eos = True
    return message


async def tokens_of(
    served: Served, message: decoder_pb2.GenerateRequest
) -> tuple[list[int], decoder_pb2.Finished]:
    tokens, finished = [], None
    async for response in served.client.generate(message):
        if response.HasField("delta"):
            tokens.extend(response.delta.token_ids)
        elif response.HasField("finished"):
            finished = response.finished
    assert finished is not None
    return tokens, finished


def record_steps(served: Served) -> list[set[int]]:
    """Each step's set of adapter slots from now on (-1: base rows), one set per running request."""
    runner = served.engine.core.runner
    steps: list[set[int]] = []
    execute = runner.execute

    def recording(plan):
        steps.append(
            {item.request.adapter_slot for item in plan.scheduled} if len(plan.scheduled) == 4 else set()
        )
        return execute(plan)

    runner.execute = recording
    return steps


async def test_three_adapters_and_the_base_in_one_running_batch_give_peft_s_tokens(
    lora_decoder: Served, references: dict[str, list[int]], llama: tuple[Path, dict[str, Path]]
) -> None:
    steps = record_steps(lora_decoder)
    names = ["", *SPECS]
    results = await asyncio.gather(*(tokens_of(lora_decoder, request(name)) for name in names))
    for name, (tokens, _) in zip(names, results, strict=True):
        assert tokens == references[name], name or "base"
    assert {-1, 0, 1, 2} in steps  # a step that ran all four, three adapters and the base

    # The same prompt as embedding rows (the checkpoint's own table), and with speculation.
    table = lora_decoder.engine.loaded.model.embed_tokens.weight
    rows = table[torch.tensor(PROMPT)].detach().float().numpy()
    embeddings = decoder_pb2.PromptSegment(
        embeddings=tensor_pb2.Tensor(
            dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=rows.shape, data=rows.tobytes()
        )
    )
    as_rows = await asyncio.gather(*(tokens_of(lora_decoder, request(name, embeddings)) for name in names))
    speculating = await asyncio.gather(
        *(tokens_of(lora_decoder, request(name, speculative_tokens=3)) for name in names)
    )
    for name, (tokens, _), (spec_tokens, _) in zip(names, as_rows, speculating, strict=True):
        assert tokens == references[name], f"{name or 'base'} from embedding rows"
        assert spec_tokens == references[name], f"{name or 'base'} speculating"
    assert sum(f.proposed_tokens for _, f in speculating) > 0  # the verify rows ran the adapters

    info = await lora_decoder.client.model_info()
    assert [(a.name, a.path, a.rank, list(a.target_modules)) for a in info.adapters] == [
        (name, name, SPECS[name].rank, list(SPECS[name].targets))  # path: relative to --lora-root
        for name in sorted(SPECS)
    ]
    assert (info.max_loras, info.max_lora_rank) == (4, 16)


async def test_an_adapters_prefix_is_never_served_from_another_adapters_blocks(lora_decoder: Served) -> None:
    _, first = await tokens_of(lora_decoder, request("qv4"))
    _, again = await tokens_of(lora_decoder, request("qv4"))
    _, other = await tokens_of(lora_decoder, request("mlp8"))
    assert first.usage.cached_input_tokens == 0 and again.usage.cached_input_tokens > 0
    assert other.usage.cached_input_tokens == 0


async def _alone(served: Served, first: list[int]) -> list[int]:
    """qv4's long stream with nothing beside it: what it must still be beside adapters coming and going.
    Its first NUM_TOKENS are peft's; past them a tiny random model meets near-ties (at token 105 peft's
    top two logits are 4.8e-7 apart) that a sum in another order (our C float32 linears, MKL's in
    transformers) may break the other way, so the long stream is compared with itself, not with peft."""
    tokens = (await tokens_of(served, request("qv4", max_new_tokens=LONG)))[0]
    assert tokens[:NUM_TOKENS] == first  # peft's
    return tokens


async def test_adapters_load_unload_and_reload_while_another_adapters_stream_runs_unchanged(
    llama: tuple[Path, dict[str, Path]], references: dict[str, list[int]]
) -> None:
    model_dir, adapters = llama
    served = await serve(
        model_dir,
        None,
        enable_lora=True,
        loras=(("qv4", adapters["qv4"]),),
        max_loras=2,
        lora_root=model_dir.parent,
    )
    try:
        client = served.client
        long_reference = await _alone(served, references["qv4"])
        running = asyncio.ensure_future(tokens_of(served, request("qv4", max_new_tokens=LONG)))
        while not served.engine.core.num_live():
            await asyncio.sleep(0.001)
        loaded = await client.load_adapter("mlp8", str(adapters["mlp8"]))  # absolute, inside the root
        assert (loaded.name, loaded.path, loaded.rank) == ("mlp8", "mlp8", 8)
        assert (await tokens_of(served, request("mlp8")))[0] == references["mlp8"]
        assert await client.unload_adapter("mlp8") == 0
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await tokens_of(served, request("mlp8"))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND and "'mlp8'" in refused.value.details()
        assert (await client.load_adapter("mlp8", "mlp8")).path == "mlp8"  # relative to the root
        assert (await tokens_of(served, request("mlp8")))[0] == references["mlp8"]
        assert not running.done(), "the long stream ended before the adapters changed: nothing was tested"
        assert await client.unload_adapter("qv4") == 1  # in use: it finishes with its adapter
        assert [a.name for a in await client.list_adapters()] == ["mlp8"]
        assert (await running)[0] == long_reference
        await client.load_adapter("all16", str(adapters["all16"]))  # qv4's slot is free again
    finally:
        await shutdown(served)


async def test_bad_adapter_calls_get_their_status_and_load_nothing(
    lora_decoder: Served, llama: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    _, adapters = llama
    client = lora_decoder.client

    async def status_of(call) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        return raised.value.code(), raised.value.details()

    code, details = await status_of(tokens_of(lora_decoder, request("nope")))
    assert code == grpc.StatusCode.NOT_FOUND and "adapter 'nope' is not loaded" in details
    too_big = adapters["all16"].parent / "r32"  # inside --lora-root
    shutil.copytree(adapters["all16"], too_big, dirs_exist_ok=True)
    config = json.loads((too_big / "adapter_config.json").read_text())
    (too_big / "adapter_config.json").write_text(json.dumps(config | {"r": 32}))
    code, details = await status_of(client.load_adapter("big", "r32"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "adapter_config.json:r" in details
    (too_big / "adapter_config.json").unlink()  # named by the path the caller sent, not the server's
    code, details = await status_of(client.load_adapter("big", "r32"))
    assert details == "adapter_config.json: adapter_config.json not found in r32"
    # Outside the root, whether there or not, through '..' or a symlink: one refusal, naming the flag.
    shutil.copytree(adapters["qv4"], tmp_path / "outside")
    (too_big / "link").symlink_to(tmp_path / "outside")
    for path in (str(tmp_path / "outside"), str(tmp_path / "missing"), "../outside", "r32/link", "nope"):
        code, details = await status_of(client.load_adapter("again", path))
        assert (code, details) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "path: must name an adapter directory inside the server's --lora-root, relative to it and "
            f"without '..', got {echo(path)}",
        )
    # A path of 4 KB in another script than Latin: its echo is cut short. Echoed whole, the status
    # went over the client's metadata limit, RESOURCE_EXHAUSTED "Stream removed" in place of the
    # refusal (common/.../status.py).
    code, details = await status_of(client.load_adapter("again", "/missing/" + "\u8a9e" * 1360))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "got '/missing/\u8a9e" in details
    code, _ = await status_of(client.load_adapter("qv4", str(adapters["qv4"])))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    await client.load_adapter("fourth", str(adapters["qv4"]))
    code, details = await status_of(client.load_adapter("fifth", str(adapters["qv4"])))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-loras" in details
    model_name = (await client.model_info()).model
    code, _ = await status_of(client.load_adapter(model_name, str(adapters["qv4"])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert [a.name for a in await client.list_adapters()] == ["all16", "fourth", "mlp8", "qv4"]
    # An unload names its field and limit as a load does (it answered NOT_FOUND, echoing 10,000
    # characters), and a name spelled apart from a loaded one that looks the same is refused on both.
    for name, rule in (("", "must be 1 to 256 bytes, got 0"), ("z" * 10_000, "must be 1 to 256 bytes")):
        code, details = await status_of(client.unload_adapter(name))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"name: {rule}")
    twin = "fourthe\u0301"  # "fourthé" decomposed
    for call in (client.load_adapter(twin, str(adapters["qv4"])), client.unload_adapter(twin)):
        code, details = await status_of(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "composed form (NFC)" in details
    assert [a.name for a in await client.list_adapters()] == ["all16", "fourth", "mlp8", "qv4"]


async def test_a_server_without_lora_refuses_adapters(
    decoder: Served, llama: tuple[Path, dict[str, Path]]
) -> None:
    _, adapters = llama
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await decoder.client.load_adapter("qv4", str(adapters["qv4"]))
    assert (
        raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "--enable-lora" in raised.value.details()
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await tokens_of(decoder, request("qv4"))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_server_without_lora_root_serves_its_start_up_adapters_and_loads_none_at_run_time(
    llama: tuple[Path, dict[str, Path]],
) -> None:
    # vLLM loads no adapter at run time unless told to; a caller could make the server open any path.
    model_dir, adapters = llama
    served = await serve(model_dir, None, enable_lora=True, loras=(("qv4", adapters["qv4"]),), max_loras=2)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await served.client.load_adapter("mlp8", "mlp8")
        assert (raised.value.code(), raised.value.details()) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "path: this server loads adapters at start only (--lora): start it with --lora-root DIR",
        )
        # The operator's own adapter, by its directory's name: the server's path is no caller's business.
        assert [(a.name, a.path) for a in await served.client.list_adapters()] == [("qv4", "qv4")]
    finally:
        await shutdown(served)


async def test_an_install_whose_caller_gave_up_is_skipped_and_the_engine_and_its_streams_go_on(
    llama: tuple[Path, dict[str, Path]], references: dict[str, list[int]]
) -> None:
    # A LoadAdapter whose deadline passed while its install waited for a step boundary cancels the
    # install's future; the engine thread then ran it and set its result, raising InvalidStateError:
    # the engine failed and every open stream ended UNAVAILABLE (from an adversarial pass).
    model_dir, adapters = llama
    served = await serve(
        model_dir,
        None,
        enable_lora=True,
        loras=(("qv4", adapters["qv4"]),),
        max_loras=2,
        lora_root=model_dir.parent,
    )
    try:
        core = served.engine.core
        long_reference = await _alone(served, references["qv4"])
        running = asyncio.ensure_future(tokens_of(served, request("qv4", max_new_tokens=LONG)))
        while not core.num_live():
            await asyncio.sleep(0.001)
        ran: list[int] = []
        installing = core.between_steps(lambda: ran.append(1))
        if installing.cancel():  # else the engine thread took it first: nothing to test this time
            assert (await tokens_of(served, request("qv4")))[0] == references["qv4"]  # steps ran since
            assert ran == []
        assert (await running)[0] == long_reference
        loaded = await served.client.load_adapter("mlp8", str(adapters["mlp8"]))
        assert loaded.name == "mlp8" and served.engine.is_healthy
    finally:
        await shutdown(served)


async def test_work_for_between_steps_after_the_engine_stopped_fails_at_once(
    llama: tuple[Path, dict[str, Path]],
) -> None:
    # A LoadAdapter whose file read ended after the engine stopped queued its install where no thread
    # would run it, and waited for its deadline (forever without one).
    model_dir, adapters = llama
    served = await serve(model_dir, None, enable_lora=True, max_loras=2, lora_root=model_dir.parent)
    await shutdown(served)
    late = served.engine.core.between_steps(lambda: None)
    assert late.done() and "shutting down" in str(late.exception())


async def test_a_load_whose_caller_leaves_after_its_install_began_stays_and_its_retry_is_already_exists(
    llama: tuple[Path, dict[str, Path]], references: dict[str, list[int]]
) -> None:
    """The install runs on the engine thread and is not undone: the adapter serves, ListAdapters shows
    its path, and a retry is ALREADY_EXISTS (the weights served are the first load's, whatever the
    files hold now), as vLLM's /v1/load_lora_adapter answers a retry 400 "has already been loaded"."""
    model_dir, adapters = llama
    served = await serve(model_dir, None, enable_lora=True, max_loras=2, lora_root=model_dir.parent)
    try:
        lora = served.engine.lora
        write, began, release = lora.write, threading.Event(), threading.Event()

        def slow_write(slot, adapter) -> None:  # on the engine thread, the install under way
            began.set()
            release.wait(30)
            write(slot, adapter)

        lora.write = slow_write
        loading = asyncio.ensure_future(served.client.load_adapter("qv4", str(adapters["qv4"])))
        assert await asyncio.to_thread(began.wait, 30)
        loading.cancel()  # the caller leaves
        with pytest.raises(asyncio.CancelledError):
            await loading
        release.set()
        while not await served.client.list_adapters():
            await asyncio.sleep(0.01)
        assert [(a.name, a.path) for a in await served.client.list_adapters()] == [("qv4", "qv4")]
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await served.client.load_adapter("qv4", str(adapters["qv4"]))
        assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert (await tokens_of(served, request("qv4")))[0] == references["qv4"]
    finally:
        release.set()
        await shutdown(served)
