"""`tandem wait`: block until services serve, for scripts that start them in the background.

`tandem up &` returns at once; the services then load their model. `tandem wait` (by default the
encoder at 127.0.0.1:50051 and the decoder at 127.0.0.1:50052) returns 0 once each serves, or 1 with
a line naming what did not within `--timeout-s` (`inf`: no limit, until interrupted; 0 is refused,
pointing at inf, since `wait-for-it -t 0` waits for ever where a deadline of 0 would probe once; NaN,
negative numbers and more than a year are refused). An `http://` target is an HTTP health URL, e.g.
the OpenAI gateway's `http://127.0.0.1:8000/health` (`tandem.readiness`).
"""

from __future__ import annotations

import math
import os
import sys
import urllib.parse
from typing import Any

import click

from tandem.common.flags import (
    CONTEXT_SETTINGS,
    FlagError,
    option,
)

PROG = "tandem wait"
DEFAULT_TARGETS = ("127.0.0.1:50051", "127.0.0.1:50052")  # `tandem up`'s encoder and decoder
# The longest finite --timeout-s: a year, far past any model's load, and under threading.TIMEOUT_MAX
# (9,223,372,036 s on Linux), so any wait given it can take it: 1e308 was taken and meant no limit, yet
# threading's waits raise OverflowError from about 1e10 s. A longer wait is inf.
MAX_TIMEOUT_S = 365 * 86_400.0


class _Timeout(click.ParamType):
    """--timeout-s: seconds above 0 and at most MAX_TIMEOUT_S, or the word inf for no limit. One
    refusal states the whole bound: 1e400 (float's inf, but no word for it) was said "above 0" where
    1e308 was said "at most a year", and 0 points at inf, since `wait-for-it -t 0` and `timeout 0` wait
    for ever where a deadline of 0 would probe once."""

    name = "SECONDS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if str(value).strip().lower().lstrip("+") in ("inf", "infinity"):
            return math.inf
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not 0 < seconds <= MAX_TIMEOUT_S:  # NaN fails it too: a wait for NaN seconds never ends
            why = " (wait-for-it's -t 0 waits for ever; inf does that here)" if seconds == 0 else ""
            self.fail(
                f"must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:,.0f} (a year), or inf "
                f"for no limit, got {value!r}{why}",
                param,
                ctx,
            )
        return seconds


def command() -> click.Command:
    # Before grpc is imported (client_security_flags imports it), which reads it then: gRPC core logs
    # each failed TLS handshake (a --tls probe of a plaintext port: "I1208 ... ssl_transport_security.cc
    # ... Handshake failed", 7 lines in 2 s) where the probe's reason says it in the one line. Its errors
    # still show, and a GRPC_VERBOSITY already set is kept. This module is loaded for `tandem wait` only.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from tandem.common.client_security_flags import client_security_options

    return click.Command(
        "wait",
        params=[
            click.Argument(["targets"], nargs=-1),
            option(
                "--timeout-s",
                "give up after this many seconds, above 0 and at most a year (31,536,000); inf: as long as "
                "it takes (wait-for-it's -t 0)",
                type=_Timeout(),
                default=120.0,
            ),
            *client_security_options(),
        ],
        callback=_wait,
        help="Wait until every TARGET serves: host:port (gRPC health SERVING) or an http:// health URL "
        f"(200). Without TARGETs: {' and '.join(DEFAULT_TARGETS)}, what `tandem up` starts.",
        context_settings=CONTEXT_SETTINGS,
    )


def _wait(targets: tuple[str, ...], timeout_s: float, **values: Any) -> int:
    from tandem.common.client_security_flags import checked_client_security
    from tandem.readiness import Probe

    for target in targets:
        problem = target_problem(target)
        if problem is not None:  # else probed until --timeout-s, each probe failing the same way
            raise FlagError(f"TARGET {target!r}: {problem}")
    security = checked_client_security(values)  # FlagError naming the flag of a file it cannot use
    plain = next((t for t in targets if t.startswith("http://")), None)
    if security.uses_tls and plain is not None:  # urllib would probe it in plain HTTP, saying nothing
        raise FlagError(
            f"TARGET {plain!r}: --tls and its files are for gRPC targets; an http:// URL is plain HTTP "
            "(an https:// one is checked against the system's CAs)"
        )
    probe = Probe(targets or DEFAULT_TARGETS, security)
    try:
        waiting = probe.wait(None if math.isinf(timeout_s) else timeout_s)  # None: no deadline
    finally:
        probe.close()
    if waiting:
        said = "; ".join(f"{target}: {reason}" for target, reason in waiting.items())
        print(f"{PROG}: not serving after {timeout_s:g} s: {said}", file=sys.stderr)
        return 1
    # One write for the whole line: `tandem up &` prints to the same terminal or pipe at this moment,
    # and print()'s separate write of the newline (stdout unbuffered) let its line land inside ours.
    sys.stdout.write(f"serving: {', '.join(probe.targets)}\n")
    sys.stdout.flush()
    return 0


def target_problem(target: str) -> str | None:
    """Why `target` is not one to probe (None when it is): a gRPC host:port (or dns:///name:port), or an
    http(s):// URL with a host and a port in range."""
    from tandem.readiness import is_http

    if is_http(target):
        try:
            url = urllib.parse.urlsplit(target)
            url.port  # noqa: B018 (raises ValueError for a port out of range)
        except ValueError as error:
            return str(error)
        return None if url.hostname else "an http:// URL needs a host, e.g. http://127.0.0.1:8000/health"
    from tandem.client.addresses import channel_target

    if "," in target:
        return "one server per TARGET (give each its own)"
    try:
        channel_target(target)
    except ValueError as error:
        return str(error)
    return None
