"""Who a Generate comes from, so that callers share the engine fairly (`scheduling/admission_order.py`).

With bearer tokens on, a caller is its token: all of one key's connections are one caller, and a
client cannot split itself into many by opening more connections. Without them, a caller is its
connection (the peer address gRPC reports, as `StreamLimit` counts them): the server has nothing else
it could trust, since a header would let a client name itself anew on every call. The token is kept
as a digest only, so the secret never sits in a request's state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from tandem.client.auth import AUTHORIZATION


def caller_of(peer: str, metadata: Iterable[tuple[str, Any]] | None, identify_by_token: bool) -> str:
    """The caller identity of a call from `peer` with `metadata` (the auth interceptor has already
    checked the token when `identify_by_token`)."""
    if identify_by_token:
        for key, value in metadata or ():
            if key == AUTHORIZATION:
                token = value if isinstance(value, str) else value.decode(errors="replace")
                digest = hashlib.blake2b(token.strip().partition(" ")[2].strip().encode(), digest_size=8)
                return f"token:{digest.hexdigest()}"
    return f"peer:{peer}"
