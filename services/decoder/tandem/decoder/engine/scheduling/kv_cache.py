"""Paged KV block manager with prefix caching. Pure Python: no torch, no grpc.

The model's cache is, per layer, `[2, num_blocks, block_size, kv_heads, head_dim]`; the token at
position p of a request lives in slot `block_ids[p // block_size] * block_size + p % block_size`.
This module decides which block ids each request owns; it never sees the tensors.

NOTE (invariants):
- Block 0 is the null block: padding tokens write there and padded block-table entries point there,
  so it is never handed out and never counted, free or used.
- Every other block is either held (ref_count > 0) or in the free queue (ref_count == 0), never both.
- Only a full block whose every position has been computed carries a hash. A hashed block stays in
  the hash table after its last holder frees it (it is "evictable"), so a later request with the same
  prefix reuses it, and a hit takes it back out of the free queue. It leaves the table only when the
  free queue hands it out again.
- The free queue is LRU, popped from the front. A freed request's blocks are appended tail first, so
  its last blocks (the least likely to be shared) are evicted first; freed blocks without a hash go
  to the front, because reusing them destroys nothing.

Prefix hashes form a chain, hash(block i) = blake2b(hash(block i - 1) || encoding of its positions),
so a block matches only under the same whole prefix. A token position is encoded as b"t" + 8-byte id
and an embedding position as b"e" + 1-byte length + the row's digest: the encoding is injective, so a
token id can never collide with an embedding, and equal embedding rows share cache. A request's
cache salt (its LoRA adapter's, one per load) follows b"root" as b"a" + 1-byte length + the salt: no
position starts with b"a", so two adapters, or an adapter and the base model, never share a block.
blake2b rather than Python's hash(): stable across processes (ranks, restarts) and collision-resistant.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.decoder.engine.request import Request

NULL_BLOCK_ID = 0  # the scratch block padding writes to; never allocated

PositionKey = int | tuple[str, bytes]  # a token id, or ("e", digest) for an embedding row


def position_key(request: Request, position: int) -> PositionKey:
    """What position `position` of `request` contributes to its block's hash."""
    num_prompt_tokens = request.num_prompt_tokens
    if position >= num_prompt_tokens:
        return request.output_token_ids[position - num_prompt_tokens]
    if request.is_token_ids[position]:
        return request.prompt_token_ids[position]
    return ("e", request.embedding_digests[position])


def hash_block(parent_hash: bytes | None, block_key: Sequence[PositionKey], salt: bytes = b"") -> bytes:
    """Chain hash of one full block; `parent_hash` is None for a request's first block, whose hash
    also takes the request's cache salt (its LoRA adapter's: the chain then carries it)."""
    h = hashlib.blake2b(digest_size=32)
    if parent_hash is not None:
        h.update(parent_hash)
    else:
        h.update(b"root" + (b"a" + len(salt).to_bytes(1, "little") + salt if salt else b""))
    for key in block_key:
        if isinstance(key, int):
            h.update(b"t" + key.to_bytes(8, "little"))
        else:
            digest = key[1]
            h.update(b"e" + len(digest).to_bytes(1, "little") + digest)
    return h.digest()


@dataclass(slots=True)
class _Block:
    block_id: int  # index into the cache's num_blocks dimension
    ref_count: int = 0  # number of requests whose block table holds it
    hash: bytes | None = None  # set once full and computed; cleared when handed out again


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the reserved null block), got {num_blocks}"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Keys only; the order is the eviction order. OrderedDict gives O(1) removal from the middle,
        # which a cache hit on an evictable block needs.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(NULL_BLOCK_ID + 1, num_blocks))
        self._hash_to_block: dict[bytes, int] = {}
        # Per request id: how many of its leading blocks are registered (cache hits count). Set by its
        # first allocation, dropped by free().
        self._num_registered: dict[str, int] = {}
        self.num_prefix_queries_tokens = 0  # tokens looked up in the prefix cache at admission
        self.num_prefix_hits_tokens = 0  # of those, tokens served from it

    @property
    def num_total_blocks(self) -> int:
        """Usable blocks: all but the null block."""
        return len(self._blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never-used, freed, and evictable cached ones."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        return self.num_used_blocks / self.num_total_blocks

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks matching the request's leading full blocks, and how many tokens they cover.

        Changes nothing: pass the ids to allocate_slots to take them. At least one position is left
        to compute, so the admitting step still produces logits to sample from. A request scoring its
        prompt gets no hit: a cached position would never run, and its logits are needed.
        """
        if not self.enable_prefix_caching or request.is_scoring_prompt:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for block_hash in self._hashes(request, max_blocks)[:max_blocks]:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_block_ids: Sequence[int] = ()
    ) -> bool:
        """Grow `request.block_ids` to cover its computed tokens, the cache hits in
        `new_computed_block_ids` (first allocation only) and `num_new_tokens` more.

        Returns False and changes nothing when the free queue cannot supply the blocks.
        """
        if new_computed_block_ids and request.block_ids:
            raise ValueError("cached blocks can only be taken by a request's first allocation")
        num_computed_tokens = request.num_computed_tokens + len(new_computed_block_ids) * self.block_size
        num_required = self.num_blocks_for_tokens(num_computed_tokens + num_new_tokens)
        num_new_blocks = max(0, num_required - len(request.block_ids) - len(new_computed_block_ids))
        # A hit on an evictable block takes it out of the free queue: it cannot also serve as new.
        num_revived = sum(1 for b in new_computed_block_ids if self._blocks[b].ref_count == 0)
        if num_new_blocks > len(self._free) - num_revived:
            return False
        if not request.block_ids and self.enable_prefix_caching:
            if not request.is_scoring_prompt:  # it never looked the cache up
                self.num_prefix_queries_tokens += request.num_tokens
                self.num_prefix_hits_tokens += len(new_computed_block_ids) * self.block_size
            self._num_registered[request.request_id] = len(new_computed_block_ids)
        for block_id in new_computed_block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            request.block_ids.append(block_id)
        for _ in range(num_new_blocks):
            request.block_ids.append(self._pop_free())
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the blocks that became full and computed since the last call (after a step)."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        num_registered = self._num_registered.get(request.request_id, 0)
        if num_full <= num_registered:
            return
        hashes = self._hashes(request, num_full)
        for i in range(num_registered, num_full):
            block = self._blocks[request.block_ids[i]]
            # A block taken from the cache already has its hash; if another request computed the
            # same content first, this copy stays unhashed and is recycled first once freed.
            if block.hash is None and hashes[i] not in self._hash_to_block:
                block.hash = hashes[i]
                self._hash_to_block[hashes[i]] = block.block_id
        self._num_registered[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks (finish, abort or preemption). Safe to call twice."""
        for block_id in reversed(request.block_ids):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block_id, last=False)
        request.block_ids.clear()
        self._num_registered.pop(request.request_id, None)

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.hash is not None:
            # Evict: its old content is about to be overwritten.
            if self._hash_to_block.get(block.hash) == block_id:
                del self._hash_to_block[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id

    def _hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """Chain hashes of the request's first `num_blocks` full blocks (memoized on the request)."""
        hashes = request.block_hashes
        size = self.block_size
        while len(hashes) < num_blocks:
            start = len(hashes) * size
            key = [position_key(request, p) for p in range(start, start + size)]
            hashes.append(hash_block(hashes[-1] if hashes else None, key, request.cache_salt))
        return hashes
