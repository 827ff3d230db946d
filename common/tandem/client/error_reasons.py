"""The reasons a refusal's google.rpc.ErrorInfo gives and the keys of its numbers: the contract between
a service that refuses and a caller that branches on the refusal (the gateway's 400 or 429), so neither
parses the other's message. docs/API.md ("Errors") lists them.

Metadata values are strings (google.rpc.ErrorInfo's map), numbers in decimal; each key carries its unit.
"""

from __future__ import annotations

from collections.abc import Mapping

from .errors import ErrorInfo

DECODER = "tandem.decoder"  # the domain of every reason below but CALL_LIMIT and IMAGE_TOO_LARGE
ENCODER = "tandem.encoder"  # the encoder's, which gives CALL_LIMIT and IMAGE_TOO_LARGE alone

# RESOURCE_EXHAUSTED, RetryInfo, in the domain of the server that refused (`domain_of` its service): it
# runs MAX_CALLS calls at once, streams and health checks included (tandem.common.call_bound), refused
# before the call reached its service.
CALL_LIMIT = "CALL_LIMIT"
MAX_CALLS = "maxCalls"

# INVALID_ARGUMENT, BadRequest naming `image.data`, in the encoder's domain: the picture is IMAGE_BYTES,
# over the encoder's MAX_IMAGE_BYTES (its --max-image-bytes, or what its --max-message-bytes carries),
# whether its bytes were parsed or refused unparsed. Not in ENCODER_REASONS: a decoder passes on only the
# RESOURCE_EXHAUSTED ones; the gateway, which calls Embed itself, reads it to answer 413 and hold the bound.
IMAGE_TOO_LARGE = "IMAGE_TOO_LARGE"
IMAGE_BYTES = "imageBytes"
MAX_IMAGE_BYTES = "maxImageBytes"

# The encoder's reasons and each one's keys: what a decoder passes on of an encoder's ErrorInfo, which is
# another server's word (its refusal of an encoder part: tandem.decoder.api.encoder_refusal).
ENCODER_REASONS: Mapping[str, frozenset[str]] = {CALL_LIMIT: frozenset({MAX_CALLS})}

# RESOURCE_EXHAUSTED, RetryInfo: the caller's open streams hold HELD_ENTRIES prompt-logprob entries
# (positions x (1 + top)), this stream needs NEEDED_ENTRIES more, and a caller may hold MAX_ENTRIES.
PROMPT_LOGPROB_BUDGET = "PROMPT_LOGPROB_BUDGET"
HELD_ENTRIES = "heldEntries"
NEEDED_ENTRIES = "neededEntries"
MAX_ENTRIES = "maxEntries"

# RESOURCE_EXHAUSTED, RetryInfo: the waiting queue holds MAX_WAITING_REQUESTS (--max-queue).
QUEUE_FULL = "QUEUE_FULL"
MAX_WAITING_REQUESTS = "maxWaitingRequests"

# RESOURCE_EXHAUSTED, RetryInfo: the HOLDER ("connection", "bearer token") has MAX_STREAMS Generate
# streams open, the bound its FLAG sets.
STREAM_LIMIT = "STREAM_LIMIT"
HOLDER = "holder"
MAX_STREAMS = "maxStreams"
FLAG = "flag"

# RESOURCE_EXHAUSTED, RetryInfo: the live grammars of the SCOPE ("caller", "decoder") hold HELD_BYTES of
# matcher memory, this one needs NEEDED_BYTES more and the SCOPE may hold MAX_BYTES.
GRAMMAR_MEMORY = "GRAMMAR_MEMORY"
SCOPE = "scope"
HELD_BYTES = "heldBytes"
NEEDED_BYTES = "neededBytes"
MAX_BYTES = "maxBytes"

# RESOURCE_EXHAUSTED, RetryInfo: the request's grammar took GRAMMAR_MICROSECONDS of CPU in one step,
# among the dearest of STEP_MICROSECONDS, over MAX_MICROSECONDS_PER_STEP (--max-grammar-cpu-ms-per-step).
GRAMMAR_CPU = "GRAMMAR_CPU"
GRAMMAR_MICROSECONDS = "grammarMicroseconds"
STEP_MICROSECONDS = "stepMicroseconds"
MAX_MICROSECONDS_PER_STEP = "maxMicrosecondsPerStep"

# RESOURCE_EXHAUSTED: all MAX_LORAS adapter slots (--max-loras) are taken, DRAINING_SLOTS of them
# draining (unloaded, freed once their running requests end): RetryInfo only where that is over 0; with
# every slot holding a loaded adapter only an UnloadAdapter frees one, and no retry hint is given.
LORA_SLOTS = "LORA_SLOTS"
MAX_LORAS = "maxLoras"
DRAINING_SLOTS = "drainingSlots"

# INVALID_ARGUMENT, BadRequest naming the field: the request needs NEEDED_BLOCKS KV blocks and the
# pool has MAX_BLOCKS in all, so no wait lets it in.
KV_CAPACITY = "KV_CAPACITY"
NEEDED_BLOCKS = "neededBlocks"
MAX_BLOCKS = "maxBlocks"


def decoder_info(reason: str, metadata: Mapping[str, int | str]) -> ErrorInfo:
    """The decoder's ErrorInfo for `reason`, its numbers as the strings the wire carries."""
    return info_of(DECODER, reason, metadata)


def info_of(domain: str, reason: str, metadata: Mapping[str, int | str]) -> ErrorInfo:
    """The ErrorInfo of `domain` for `reason`, its numbers as the strings the wire carries."""
    return ErrorInfo(reason, domain, {key: str(value) for key, value in metadata.items()})


def domain_of(service: str) -> str:
    """The domain of a server whose (first) service is `service`, its full proto name: the package's root
    and the service, "tandem.v1.Decoder" -> "tandem.decoder" (DECODER), "tandem.v1.Encoder" -> ENCODER."""
    root, _, rest = service.partition(".")
    return f"{root}.{rest.rpartition('.')[2].lower()}" if rest else root.lower()
