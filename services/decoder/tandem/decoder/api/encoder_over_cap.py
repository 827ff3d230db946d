"""An Embed message gRPC refused for its size: whose --max-message-bytes it was over, and what mends it.

Its own module, apart from the fetching in `encoder_parts.py`: gRPC says which cap refused a message
only in its status's text, read by `tandem.client.over_cap` (the gateway reads its Generate calls' the
same way): CLIENT is this decoder's cap, SERVER the encoder's. Whichever it was, it is the caller's input
too long, which no retry mends: `encoder_parts` makes it INVALID_ARGUMENT on the caller's field, where it
read RESOURCE_EXHAUSTED "encoder ... is full" with a RetryInfo.
"""

from __future__ import annotations

from tandem.client.over_cap import OverCap


def description(over: OverCap, max_message_bytes: int) -> str:
    """Which Embed message was over whose --max-message-bytes, and what mends it; `max_message_bytes` is
    this decoder's."""
    if over.is_ours and over.is_reply:
        return rows_too_large(max_message_bytes, f"a reply of {over.num_bytes} bytes")
    if over.is_ours:
        # An image just under the cap in the Generate call: its Embed call adds a few hundred bytes.
        return (
            f"its Embed request of {over.num_bytes} bytes (the input and the call's own fields) is "
            f"larger than this decoder's --max-message-bytes {over.max_bytes} allows: send a smaller "
            "input, or start the decoder with a larger --max-message-bytes"
        )
    what = (
        f"its rows are larger than the encoder's own --max-message-bytes {over.max_bytes} allows "
        f"(a reply of {over.num_bytes} bytes)"
        if over.is_reply
        else f"its Embed request of {over.num_bytes} bytes is larger than the encoder's "
        f"--max-message-bytes {over.max_bytes} allows"
    )
    return f"{what}: send a smaller input, or start the encoder with a larger --max-message-bytes"


def rows_too_large(max_message_bytes: int, detail: str) -> str:
    """Why rows over this decoder's --max-message-bytes are refused, whichever way they came: as bytes
    over gRPC's receive cap, or through shared memory, which passes it."""
    return (
        f"the encoder's rows are larger than this decoder's --max-message-bytes {max_message_bytes} "
        f"allows ({detail}): send a shorter input, or start the decoder with a larger --max-message-bytes"
    )
