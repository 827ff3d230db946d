"""The OpenAI gateway's configuration: one frozen object, validated when built, passed down."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.client.channel import PLAINTEXT, ChannelSecurity, channel_target
from tandem.client.errors import ConfigError
from tandem.common.cpus import available_cpus
from tandem.common.memory_limit import MemoryLimit, memory_limit
from tandem.common.server_options import DEFAULT_GRACE_S
from tandem.gateway.replica_addresses import name_of

DEFAULT_PORT = 8000  # vLLM's and SGLang's OpenAI port
MIB = 1024 * 1024
DEFAULT_BODY_WORKERS = 2
DEFAULT_LARGE_BODIES_PER_CALLER = 2  # half of --max-large-bodies' default 4
MAX_UNREAD_ANSWER_BYTES = 1024 * 1024 * MIB  # more memory than any gateway host: a bound that bounds nothing
# Fewer than the smallest answer's JSON (one empty choice: about 400 bytes, its model's name apart): a
# bound every answer passes alone, so each would wait for the gateway to hold nothing.
MIN_UNREAD_ANSWER_BYTES = 1024
# The services' own bounds on --max-message-bytes: gRPC takes it as a C int (2**31 raised an OverflowError
# as the gateway's channels opened), and the decoder and encoder refuse under 1 KiB.
MIN_MESSAGE_BYTES = 1024
MAX_MESSAGE_BYTES = 2**31 - 1
# A body's content goes on to the services in gRPC messages of at most MAX_MESSAGE_BYTES (2 GiB): a
# completion's Generate calls all together (the app's 413), each embeddings input or picture sent to the
# encoder alone. Where a body is large its content is base64 (pictures, embedding rows: 4/3 of their
# bytes in the JSON), so one full message's worth is a body of 8/3 GiB (about 2.67 GiB) and the JSON
# around it: 4 GiB is the power of two above that. A larger bound would serve only embeddings bodies of
# several inputs of 2 GiB each (or text spelled in \u escapes); past it, a flag is a mistyped count
# (2**63 was taken).
MAX_BODY_BYTES = 4 * 1024 * MIB
# OpenAI's own bound on `n`: a client written for its API asks no more in one request, and each
# choice is a decoder stream of the caller's (the decoder's default per-token bound is 256 streams).
MAX_CHOICES = 128


@dataclass(frozen=True)
class GatewayConfig:
    decoder_address: str = "127.0.0.1:50052"  # host:port, several, or dns: (balanced, as the client)
    encoder_address: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    # Accepted bearer tokens (the services' token file); None: no authentication. A caller's token is
    # passed on to the services with each call, so their per-token limits and fair sharing see it.
    auth_tokens: frozenset[str] | None = None
    upstream: ChannelSecurity = field(default=PLAINTEXT)  # TLS and token towards the services
    # A request body's bytes (a prompt of embedding rows travels as base64: 4/3 of its bytes).
    max_body_bytes: int = 96 * MIB
    # Open completion streams per caller, one per choice (its bearer token with tokens on, else its IP
    # address); 429 beyond it.
    # HTTP/1.1 carries one request a connection, so a connection bound would bound nothing.
    max_streams_per_caller: int = 32
    # Choices of one completion request: its prompts x `n`, each a Generate stream of its own. 16 keeps a
    # full request within half of the decoder's default --max-streams-per-connection (32) and of
    # `max_streams_per_caller`, so one caller's widest request never takes its whole share; a request
    # beyond it (or beyond `max_streams_per_caller`, which it could never fit) is a 400 naming `n` or
    # `prompt`. OpenAI's own bound on `n` is 128; vLLM sets none.
    max_choices: int = 16
    max_message_bytes: int = 64 * MIB  # the services' --max-message-bytes
    # The largest /v1/embeddings answer, reckoned before any work from rows x width x inputs (413 beyond).
    max_embeddings_bytes: int = 64 * MIB
    # Bodies over `large_body_bytes` are parsed and converted in worker processes (`body_workers.py`),
    # at most `max_large_bodies` at once (read, queued or converting; 503 with Retry-After beyond), and
    # at most `max_large_bodies_per_caller` of them one caller's (as `max_streams_per_caller`, its token
    # else its address; 429 with Retry-After beyond). Half of the places: one caller holding its share
    # open (a body it never finishes) leaves the other half to everyone else. A place is taken with a
    # body's first bytes, not its head: a head alone holds nothing. A share above the places means
    # nothing and is refused; None: DEFAULT_LARGE_BODIES_PER_CALLER, lowered to `max_large_bodies`
    # where that is smaller (so a default never refuses `--max-large-bodies 1`), an int once built.
    large_body_bytes: int = 1 * MIB
    max_large_bodies: int = 4
    max_large_bodies_per_caller: int | None = None
    # The JSON of non-streamed answers being written (reserved once decoded, from its tokens, settled
    # once serialized, until all sent), all callers together: an answer that would pass it waits, then
    # is a 503 with Retry-After after --write-timeout-s (`answer_bytes`); one over it alone is a 413 at
    # once, never queued (it could wait only for no caller to hold any). Answers being decoded hold
    # none of it (their memory is bounded by --max-streams-per-caller).
    # As much as the large bodies may hold coming in (4 x 96 MiB): the largest answer (16 choices of
    # 8,192 tokens with 20 alternatives: about 200 MiB of JSON, 229 MiB reserved, SmolLM2's tokens of
    # English) and as much again; a caller's own unread answers (twice its streams, in choices) are up
    # to 760 MiB, unbounded over many callers without this.
    max_unread_answer_bytes: int = 384 * MIB
    # Of those, one caller's (waits, then a 429); None: a third of them (128 MiB by default), so one
    # caller never holds what the others need. An answer over it alone (that 16-choice one) is written
    # when its caller holds nothing else and it fits the gateway's bound, held meanwhile only within
    # its caller's queue: 128 MiB holds about 8 such choices, or 200 of 131,072 English tokens without
    # logprobs.
    max_unread_answer_bytes_per_caller: int | None = None
    # None: DEFAULT_BODY_WORKERS, lowered to `max_large_bodies` where that is smaller (a worker beyond
    # it never gets a body, and a default must not refuse `--max-large-bodies 1`); an int once built.
    body_workers: int | None = None
    # Open HTTP connections (file descriptors are finite); beyond it a new one takes an idle one's place
    # (connections.py: the address holding the most waiting for a head), else is answered 503 and closed.
    max_connections: int = 512
    # Slow clients: a new connection's first request head must arrive within `header_timeout_s`; a
    # keep-alive connection idle (or trickling its next head) for `idle_timeout_s` is closed. A body is
    # a 408 (and its connection closed) when none of its bytes arrive for `body_idle_timeout_s` (a chunk
    # size that never comes, a body stopped mid-way on an open connection), or when it is not whole
    # within `body_timeout_s` (a trickle: a byte every few seconds; 96 MiB needs 1.6 MB/s).
    # vLLM's and SGLang's servers (uvicorn) and aiohttp bound no body read at all; nginx's
    # client_body_timeout is 60 s between two reads, Apache's mod_reqtimeout 20 s plus 1 s per 500 bytes.
    # A JSON body sent by a program has no reason to pause: 10 s, as for a head, cuts a stalled one six
    # times sooner than the whole-body bound did alone.
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    body_idle_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    # A caller that takes none of its answer (reads nothing while its connection stays open) for this
    # long has its connection closed and its request's decoder calls cancelled (connections.py). nginx's
    # send_timeout is 60 s between two writes that take anything; uvicorn (vLLM's, SGLang's server) and
    # aiohttp have no bound, so such a stream ran on to max_tokens, and TCP never times out a peer that
    # acknowledges but does not read. 60 s, as nginx: a client pausing between chunks to do its own work
    # keeps its answer.
    write_timeout_s: float = 60.0
    # On SIGTERM, open streams get this long to finish before they are cut: the services' --grace-s,
    # which `tandem up` passes to all three (it kills each --grace-s + 15 s after the signal).
    grace_s: float = DEFAULT_GRACE_S
    # Idle per-caller channels to the decoder kept for reuse (`callers.py`).
    max_idle_channels: int = 64

    @property
    def unread_answer_bytes_per_caller(self) -> int:
        """One caller's share of the answers held: its flag's, else a third of the gateway's."""
        if self.max_unread_answer_bytes_per_caller is not None:
            return self.max_unread_answer_bytes_per_caller
        return max(self.max_unread_answer_bytes // 3, MIN_UNREAD_ANSWER_BYTES)

    def __post_init__(self) -> None:
        if self.max_large_bodies_per_caller is None:
            share = min(DEFAULT_LARGE_BODIES_PER_CALLER, self.max_large_bodies)
            object.__setattr__(self, "max_large_bodies_per_caller", share)  # frozen: set once, here
        if self.body_workers is None:
            object.__setattr__(self, "body_workers", min(DEFAULT_BODY_WORKERS, self.max_large_bodies))
        self._check_addresses()
        for name in (
            "max_body_bytes",
            "max_streams_per_caller",
            "max_choices",
            "max_embeddings_bytes",
            "large_body_bytes",
            "max_large_bodies",
            "max_large_bodies_per_caller",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        self._check_upper_bounds()
        if not MIN_MESSAGE_BYTES <= self.max_message_bytes <= MAX_MESSAGE_BYTES:
            raise ConfigError(
                "max_message_bytes",
                f"must be in {MIN_MESSAGE_BYTES}..{MAX_MESSAGE_BYTES} (the services' bounds; gRPC's int), "
                f"got {self.max_message_bytes}",
            )
        self._check_body_workers()
        if not MIN_UNREAD_ANSWER_BYTES <= self.max_unread_answer_bytes <= MAX_UNREAD_ANSWER_BYTES:
            raise ConfigError(  # fewer than an answer's, or a count of KiB or MiB mistyped
                "max_unread_answer_bytes",
                f"must be >= {MIN_UNREAD_ANSWER_BYTES} (the smallest answer's JSON) and at most "
                f"{MAX_UNREAD_ANSWER_BYTES} (1 TiB), got {self.max_unread_answer_bytes}",
            )
        per_caller, most = self.max_unread_answer_bytes_per_caller, self.max_unread_answer_bytes
        if per_caller is not None and not MIN_UNREAD_ANSWER_BYTES <= per_caller <= most:
            raise ConfigError(
                "max_unread_answer_bytes_per_caller",
                f"must be >= {MIN_UNREAD_ANSWER_BYTES} (the smallest answer's JSON) and at most "
                f"--max-unread-answer-bytes ({self.max_unread_answer_bytes}), got {per_caller}",
            )
        # NaN fails every comparison, so `< 0` let it through (then no grace at all), and inf never
        # cut a stream, nor a slow client.
        if not (math.isfinite(self.grace_s) and self.grace_s >= 0):
            raise ConfigError("grace_s", f"must be a finite number of seconds, 0 or more, got {self.grace_s}")
        if self.max_idle_channels < 0:
            raise ConfigError("max_idle_channels", f"must be >= 0, got {self.max_idle_channels}")
        for name in (
            "header_timeout_s",
            "idle_timeout_s",
            "body_idle_timeout_s",
            "body_timeout_s",
            "write_timeout_s",
        ):
            seconds = getattr(self, name)
            if not (math.isfinite(seconds) and seconds > 0):
                raise ConfigError(name, f"must be a finite number of seconds, more than 0, got {seconds}")

    def _check_addresses(self) -> None:
        """An address the gateway cannot use is refused here, not at start: a dns: name it cannot watch
        (a task would fail on it), a list with an entry that does not resolve (resolved once at start,
        a ValueError traceback there), a port past 65535 (gRPC took 99999 as 34463, mod 65536), a host
        that is no name ('::::'). The listening host must name an address: an empty one listened on
        every interface of both families, on two different ports for --port 0, one of them logged."""
        for name in ("decoder_address", "encoder_address"):
            address = getattr(self, name)
            try:
                if name == "decoder_address":  # its replicas are watched with the system's resolver;
                    name_of(address)  # the encoder's channel resolves its name, a DNS server its own
                channel_target(address)  # a dns: target as addresses.dns_name reads it
            except ValueError as error:
                raise ConfigError(name, f": {error}") from None
        if not self.host.strip():
            raise ConfigError("host", f"must name an address (0.0.0.0: every IPv4 one), got {self.host!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be in 0..65535, got {self.port}")

    def _check_upper_bounds(self) -> None:
        """2**63 was taken for each of these, and the gateway listened promising what it could not do."""
        per_caller = self.max_large_bodies_per_caller
        if per_caller is not None and per_caller > self.max_large_bodies:
            raise ConfigError(
                "max_large_bodies_per_caller",
                f"must be at most --max-large-bodies ({self.max_large_bodies}): one caller's share of the "
                f"places cannot pass them all, got {per_caller}",
            )
        if self.max_body_bytes > MAX_BODY_BYTES:
            raise ConfigError(
                "max_body_bytes",
                f"must be at most {MAX_BODY_BYTES} (4 GiB: room for a full gRPC message's content, 2 GiB, "
                f"as base64 in JSON, 4/3 of it), got {self.max_body_bytes}",
            )
        if self.max_choices > MAX_CHOICES:
            raise ConfigError(
                "max_choices",
                f"must be at most {MAX_CHOICES} (OpenAI's own bound on n; each choice is a decoder stream), "
                f"got {self.max_choices}",
            )
        # The large bodies held at once, each up to max_body_bytes, against what this process may take:
        # in a container its cgroup's limit, not the host's memory (memory_limit's NOTE).
        limit = memory_limit()
        if limit is not None and self.max_body_bytes > limit.num_bytes:  # no count of bodies could fit
            raise ConfigError(
                "max_body_bytes",
                f"must be at most {limit.num_bytes}: one body of it is more than {_said(limit)}, "
                f"got {self.max_body_bytes}",
            )
        if limit is not None and self.max_large_bodies * self.max_body_bytes > limit.num_bytes:
            most = limit.num_bytes // self.max_body_bytes
            raise ConfigError(
                "max_large_bodies",
                f"must be at most {most}: {self.max_large_bodies} bodies of --max-body-bytes "
                f"{self.max_body_bytes} held at once are more than {_said(limit)}, "
                f"got {self.max_large_bodies}",
            )

    def _check_body_workers(self) -> None:
        """Each worker is a Python process started with the gateway (16 of them and their resource
        tracker held 629 MiB) converting one body at a time: one beyond --max-large-bodies (the bodies
        taken at once) never gets a body, one beyond the CPUs converts none faster. The default is
        allowed on a single CPU."""
        num_cpus = available_cpus()
        most = min(self.max_large_bodies, max(num_cpus, DEFAULT_BODY_WORKERS))
        if self.body_workers is None or not 1 <= self.body_workers <= most:
            raise ConfigError(
                "body_workers",
                f"must be in 1..{most} (--max-large-bodies {self.max_large_bodies} bodies are converted "
                f"at once, on {num_cpus} CPUs), got {self.body_workers}",
            )


def _said(limit: MemoryLimit) -> str:
    """What bounds this process's memory, as a refusal names it: the cgroup file, where it is one."""
    if limit.cgroup_file is None:
        return f"this host's {limit.num_bytes} bytes of memory"
    return f"the {limit.num_bytes} bytes this process may take (its cgroup's limit, {limit.cgroup_file})"
