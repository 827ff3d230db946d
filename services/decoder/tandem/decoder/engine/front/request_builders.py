"""The threads requests are built on for the asyncio front, and which of them builds a given request.

Request building and tokenizing run here, never on the event loop: a long text or a large embedding
tensor would stall every stream and health probe for its duration. Each kind of dear work has threads
of its own, so that it queues behind its own kind and never in front of cheaper requests; the threads
that build for several callers take them in turn (fair_builder.py): one caller's burst of dear builds
holds another's request back by at most one build per caller.
"""

from __future__ import annotations

import concurrent.futures

import torch

from tandem.decoder.engine.admission import template_worker
from tandem.decoder.engine.admission.prompt import GenerateSpec, has_encoder_parts
from tandem.decoder.engine.front.fair_builder import FairBuilder

FETCHING_BUILDERS = 8  # requests built at once while they wait for their encoder parts' rows


class RequestBuilders:
    """One engine's request-building threads: plain prompts, chats, grammars, and encoder fetches."""

    def __init__(self) -> None:
        # Plain prompts: one thread, so that heavy requests queue behind each other, not beside the
        # model. The engine's tokenize() runs here too, in its caller's turn.
        self.plain = FairBuilder(1, "tandem-requests", init_builder_thread)
        # Chat requests build beside it, as many at once as there are template workers: a render
        # waits on its worker process (admission/template_worker.py, up to its time bound), and a
        # slow template must hold up neither other callers' plain prompts nor, up to that many,
        # their chats.
        self.chat = FairBuilder(template_worker.WORKERS, "tandem-chats", init_builder_thread)
        # Prompts and chats with a grammar build here: compiling one costs up to a few hundred
        # milliseconds (llguidance's bounds, sampling/structured.py), and 6 hostile ones queued on
        # the plain builder held a neighbour's first token back 16-20 s. One thread: grammars queue
        # behind each other, never in front of prompts or chats without one.
        self.structured = FairBuilder(1, "tandem-grammars", init_builder_thread)
        # Requests with encoder parts build here: each waits for its encoder's rows (a vision tower's
        # tens of milliseconds), which must hold up neither plain prompts nor chats; the threads only
        # wait, so there can be several.
        self.fetching = concurrent.futures.ThreadPoolExecutor(
            max_workers=FETCHING_BUILDERS,
            thread_name_prefix="tandem-fetching",
            initializer=init_builder_thread,
        )

    def for_spec(self, spec: GenerateSpec) -> concurrent.futures.Executor:
        """The threads that build `spec`, in its caller's turn where they take turns."""
        if has_encoder_parts(spec):
            return self.fetching  # its threads only wait (on the encoder): no turns needed
        if spec.structured is not None:
            # A chat's too (its template rendered there): compiled on the chat threads, a caller's 24
            # schemas of 49 KB held its plain chat 2-4.6 s, and with both threads compiling, every
            # other caller's chat waited for one (0.75 s).
            return self.structured.for_caller(spec.caller)
        return (self.plain if spec.chat is None else self.chat).for_caller(spec.caller)

    def shutdown(self) -> None:
        """Stop every builder without waiting; requests not yet built are cancelled."""
        self.plain.shutdown(wait=False, cancel_futures=True)
        self.chat.shutdown(wait=False, cancel_futures=True)
        self.fetching.shutdown(wait=False, cancel_futures=True)
        self.structured.shutdown(wait=False, cancel_futures=True)


def init_builder_thread() -> None:
    # One intra-op thread: a parallel op here would start a second OpenMP team, which slows the
    # engine thread's own ops (see loop.py); casting one request's rows needs no team.
    torch.set_num_threads(1)
