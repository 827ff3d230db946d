"""An Embed reply's rows, read for `encoder_parts.py`: from the shared-memory segment its call offered,
or from its bytes, checked in the model's dtype and width and finite before they are cached.

Its own module, apart from the fetching: what a reply holds, where it came from and whether it is the
rows it claims (step 3 of `encoder_parts.py`'s account). A reply wrong in itself raises InvalidArgument
on a field relative to the part, which the fetch reports as the encoder's fault; a segment lost before
it was read raises SegmentLost, which the fetch answers by asking again by value.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from pathlib import Path

import torch

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import encoder_pb2, tensor_pb2
from tandem.common.torch_part import shared_memory, shm_digest, shm_probe, shm_segment_maps, tensors
from tandem.decoder.backends.cpu import copy_digest

READ_ON_A_THREAD_BYTES = 1024 * 1024  # rows sent as bytes this large are checked off the event loop


class SegmentLost(Exception):
    """The rows a reply put in shared memory were gone, changed, or could not be opened, before this
    decoder read them: its lease ran out. The decoder's own timing, never the caller's input: fetched
    again by value."""


class EmbedReplies:
    """Reads one decoder's Embed replies. `dtype` and `hidden_size` are the model's: the rows are cast
    to the one and checked finite in it, and rows of another width are refused (None: not checked here,
    only at admission). `max_message_bytes` bounds the rows, as it bounds a caller's own tensors."""

    def __init__(
        self, dtype: torch.dtype, hidden_size: int | None, max_message_bytes: int, shm_dir: Path
    ) -> None:
        self.dtype = dtype
        self.hidden_size = hidden_size
        self.shm_dir = shm_dir
        self.probe = shm_probe.Probe.create(shm_dir)  # None: shared memory is never offered
        # The encoder's pool segments, mapped once each and read through the mapping every later call,
        # each read copied and digested in one pass where this CPU has the fused kernel.
        try:
            self.maps = (
                shm_segment_maps.SegmentMaps(shm_dir, copy_digest=copy_digest.for_cpu())
                if self.probe is not None
                else None
            )
        except BaseException:  # its kernels, its sweeper's thread: no object is returned to close the probe
            if self.probe is not None:
                self.probe.close()  # its file and the descriptor holding its lock
            raise
        # An embedding tensor can never be larger than a message, as for the caller's own tensors.
        self.limits = tensors.TensorLimits(max_elements=max_message_bytes // 2)
        self.num_shared = 0  # replies read from shared memory
        self.num_bytes = 0  # replies that carried their rows as bytes

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
        if self.maps is not None:
            self.maps.close()

    async def read(
        self, reply: encoder_pb2.EmbedResponse, offer: encoder_pb2.SharedMemoryOffer | None
    ) -> torch.Tensor:
        """The rows of `reply`, from the segment `offer` asked for or from its bytes; errors on fields
        relative to the part (the reply's fault, which `EncoderParts._embed` reports as the encoder's).
        Raises SegmentLost when the segment is gone or no longer what was written."""
        if reply.HasField("shared_embeddings"):
            handle = reply.shared_embeddings
            if offer is None or handle.name != offer.segment_name:
                raise InvalidArgument(".shared_embeddings.name", "names a segment this call did not ask for")
            # On a thread whatever the rows' size: the first handle of a pool segment maps the whole
            # segment (MAP_POPULATE fills its page tables), which the encoder makes up to
            # --shared-memory-bytes (1 GiB): 60-94 ms for 1 GiB, 3-6 ms for 64 MiB, here, and a
            # 768-byte reply may be given a large free segment. On the loop it held every stream.
            result = await asyncio.to_thread(self._read_segment, handle, offer.digest_key)
            self.num_shared += 1
            return result
        rows = tensors.decode(reply.embeddings, ".embeddings", rank=2, limits=self.limits)
        if rows.nbytes > READ_ON_A_THREAD_BYTES:
            result = await asyncio.to_thread(self._checked, rows, ".embeddings")
        else:
            result = self._checked(rows, ".embeddings")
        self.num_bytes += 1
        return result

    def _checked(self, rows: torch.Tensor, where: str) -> torch.Tensor:
        """`rows` in the model's dtype, checked [n, hidden_size] and finite in it before they are cached
        (admission checks every call's rows again): rows holding NaN or Inf, or of another width, kept,
        refused every later call of the same input until evicted, the encoder's fault outliving its
        fix; the width was refused only at admission, INVALID_ARGUMENT on the caller's field. A fetch's
        cost alone, not a cache hit's; off the event loop where the rows are large, as reading them is
        (19 ms for 576 x 4,096 bf16 rows at one thread, 163 ms for 8,192)."""
        # Rank 2 and n >= 1 are decode's (`rank=2`, no empty dimension); the width is the model's.
        if self.hidden_size is not None and rows.shape[1] != self.hidden_size:
            raise InvalidArgument(
                f"{where}.shape",
                f"rows {list(rows.shape)}, this decoder's model takes [n >= 1, {self.hidden_size}] (is "
                "the encoder serving another model?)",
            )
        cast = rows.to(self.dtype)
        tensors.require_finite(cast, where, sent=rows)
        return cast

    def _read_segment(self, handle: tensor_pb2.SharedTensor, key: bytes) -> torch.Tensor:
        """The rows of the segment a reply names, checked and copied into this process, and the name
        removed: read once, and the segment released to the encoder's pool. Fields are the part's own."""
        where = ".shared_embeddings"
        assert self.maps is not None, "a handle is read only for a call that offered shared memory"
        try:
            segment = self.maps.open(handle.name)
        except OSError as error:  # this host's (a race with the encoder's pool, a limit): by value
            # Released to the pool, as a read does; a name this process may not remove (EPERM, EISDIR:
            # not the encoder's file) is left, its own error no reason to fail the call unclassified.
            with contextlib.suppress(OSError):
                shared_memory.remove(self.shm_dir, handle.name)
            raise SegmentLost(f"its segment could not be opened ({error})") from None
        if segment is None:
            raise SegmentLost("its segment was gone before it was read (the encoder's lease ran out)")
        try:
            with segment:
                rows = tensors.decode_shared(handle, segment, key, where, rank=2, limits=self.limits)
        except InvalidArgument as error:
            # The lease ran out while it was read and the encoder wrote the segment again, or the file
            # was cut meanwhile (decode_shared's bounded read found it shorter than when it was checked).
            if error.field == f"{where}.digest" or error.description.startswith("the segment shrank"):
                raise SegmentLost(f"its segment changed while it was read ({error.description})") from None
            raise
        finally:
            shared_memory.remove(self.shm_dir, handle.name)
        return self._checked(rows, where)

    def offer(self) -> encoder_pb2.SharedMemoryOffer | None:
        """A fresh segment name and digest key for one call, with this decoder's proof; None without one."""
        if self.probe is None:
            return None
        return encoder_pb2.SharedMemoryOffer(
            probe_name=self.probe.name,
            probe_token=self.probe.token,
            segment_name=shared_memory.new_name(shared_memory.SEGMENT_PREFIX),
            digest_key=secrets.token_bytes(shm_digest.KEY_BYTES),
        )
