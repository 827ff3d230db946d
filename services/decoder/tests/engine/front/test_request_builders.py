"""Which threads build a request for the asyncio front: a grammar being compiled holds up neither a
plain prompt nor a chat, and a request waiting for its encoder's rows holds up none of them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from pathlib import Path

import pytest

from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.chat import ChatMessage, ChatRequest
from tandem.decoder.engine.admission.prompt import EncoderPrompt, GenerateSpec, TextPrompt
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.front.request_builders import RequestBuilders
from tandem.decoder.engine.outputs.outputs import Event, Finished
from tandem.decoder.engine.params import StoppingParams, StructuredOutput
from tandem.decoder.models.loader import LoadedModel

PROMPT = [3, 4]
CHAT = ChatRequest(messages=[ChatMessage("user", [TextPrompt("hi")])])
GRAMMAR = StructuredOutput("regex", "a+")


def _engine(model_dir: Path, loaded: LoadedModel) -> Engine:
    settings = dict(model_dir=model_dir, dtype="float32", num_kv_blocks=512, block_size=4, max_num_seqs=16)
    return Engine(EngineConfig(**settings), loaded)


def _rows() -> concurrent.futures.Future:
    """An encoder part's rows, still being fetched."""
    return concurrent.futures.Future()


@pytest.mark.parametrize(
    ("spec", "thread"),
    [
        (GenerateSpec([PROMPT]), "tandem-requests"),
        (GenerateSpec([], chat=CHAT), "tandem-chats"),
        (GenerateSpec([PROMPT], structured=GRAMMAR), "tandem-grammars"),
        (GenerateSpec([], chat=CHAT, structured=GRAMMAR), "tandem-grammars"),
        # Waiting on its encoder: on the fetching threads, grammar or not.
        (GenerateSpec([EncoderPrompt("image", b"jpeg", _rows())], structured=GRAMMAR), "tandem-fetching"),
    ],
    ids=["plain", "chat", "grammar", "chat-with-grammar", "encoder-part"],
)
def test_each_kind_of_request_is_built_on_threads_of_its_own(spec: GenerateSpec, thread: str) -> None:
    builders = RequestBuilders()
    try:
        name = builders.for_spec(spec).submit(lambda: threading.current_thread().name).result(timeout=30)
    finally:
        builders.shutdown()
    assert name.startswith(f"{thread}_")


def test_a_plain_prompt_is_not_built_behind_a_grammar_being_compiled(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    """Six hostile grammars, 2 s each to compile, on the one request-building thread held a plain
    neighbour's first token back 16-20 s: grammars build on a thread of their own."""
    stopping = StoppingParams(max_new_tokens=2)
    grammar = GenerateSpec([PROMPT], stopping=stopping, structured=StructuredOutput("regex", "a+"))
    plain = GenerateSpec([PROMPT], stopping=stopping)
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        compiling, release = threading.Event(), threading.Event()
        make_request = engine.make_request

        def slow_grammars(spec: GenerateSpec):
            if spec.structured is not None:
                compiling.set()
                release.wait(5)
            return make_request(spec)

        engine.make_request = slow_grammars

        async def collect(spec: GenerateSpec) -> list[Event]:
            return [event async for event in engine.stream(spec)]

        async def run() -> tuple[list[Event], list[Event]]:
            constrained = asyncio.ensure_future(collect(grammar))
            while not compiling.is_set():
                await asyncio.sleep(0.01)
            try:
                beside = await asyncio.wait_for(collect(plain), 3)
            finally:
                release.set()
            return beside, await constrained

        beside, constrained = asyncio.run(run())
    assert isinstance(beside[-1], Finished) and isinstance(constrained[-1], Finished)


def test_a_chat_is_not_built_behind_chats_whose_grammars_are_being_compiled(
    tiny_model_dir: Path, tiny_fp32: LoadedModel
) -> None:
    """Chats with a grammar compiled on the chat threads: a caller's 24 schemas held its own plain chat
    2-4.6 s behind them, and two at once (as many as the threads) held every caller's. They build on
    the grammar thread, as prompts with one do."""
    stopping = StoppingParams(max_new_tokens=2)
    chat = ChatRequest(messages=[ChatMessage("user", [TextPrompt("hi")])])
    grammar = GenerateSpec([], stopping=stopping, chat=chat, structured=StructuredOutput("regex", "a+"))
    plain = GenerateSpec([], stopping=stopping, chat=chat)
    with _engine(tiny_model_dir, tiny_fp32) as engine:
        compiling, release = threading.Semaphore(0), threading.Event()
        make_request = engine.make_request

        def slow_grammars(spec: GenerateSpec):
            if spec.structured is not None:
                compiling.release()
                release.wait(5)
            return make_request(spec)

        engine.make_request = slow_grammars

        async def collect(spec: GenerateSpec) -> list[Event]:
            return [event async for event in engine.stream(spec)]

        async def run() -> tuple[list[Event], list[list[Event]]]:
            constrained = [asyncio.ensure_future(collect(grammar)) for _ in range(2)]  # one a chat thread
            while not compiling.acquire(blocking=False):
                await asyncio.sleep(0.01)
            try:
                beside = await asyncio.wait_for(collect(plain), 3)
            finally:
                release.set()
            return beside, list(await asyncio.gather(*constrained))

        beside, constrained = asyncio.run(run())
    assert isinstance(beside[-1], Finished)
    assert all(isinstance(events[-1], Finished) for events in constrained)
