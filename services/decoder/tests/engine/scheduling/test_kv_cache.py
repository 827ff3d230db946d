"""BlockManager: paged blocks, the reserved null block, and prefix caching over a hash chain."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from services.decoder.tests.engine.scheduling_helpers import embedding, make_request
from tandem.decoder.engine.request import Request, TokenSegment
from tandem.decoder.engine.scheduling.kv_cache import BlockManager, hash_block

BLOCK_SIZE = 4


def admit(manager: BlockManager, request: Request) -> bool:
    """What the scheduler does on admission: take cache hits, then blocks for the whole rest."""
    block_ids, num_cached = manager.get_computed_blocks(request)
    if not manager.allocate_slots(request, request.num_tokens - num_cached, block_ids):
        return False
    request.num_computed_tokens = num_cached
    return True


def compute_all(manager: BlockManager, request: Request) -> None:
    """What update() does after the step that computed every position."""
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)


def test_allocate_then_free_returns_free_blocks_to_initial_count() -> None:
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(10)))

    assert manager.allocate_slots(request, 10)
    assert len(request.block_ids) == 3
    assert manager.num_free_blocks == 9 - 3
    manager.free(request)
    assert manager.num_free_blocks == manager.num_total_blocks == 9
    assert request.block_ids == []


def test_null_block_is_never_handed_out_nor_counted() -> None:
    manager = BlockManager(num_blocks=5, block_size=BLOCK_SIZE)
    assert manager.num_total_blocks == manager.num_free_blocks == 4
    request = make_request("a", list(range(16)))

    assert manager.allocate_slots(request, 16)
    assert sorted(request.block_ids) == [1, 2, 3, 4]
    assert manager.num_free_blocks == 0
    assert manager.usage == 1.0
    assert not manager.allocate_slots(make_request("b", [1]), 1)


def test_allocation_grows_the_block_table_one_block_per_block_size_tokens() -> None:
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", [1, 2, 3])
    assert manager.allocate_slots(request, 3)
    request.num_computed_tokens = 3
    assert manager.allocate_slots(request, 1)  # position 3 still fits the first block
    assert len(request.block_ids) == 1
    request.num_computed_tokens = 4
    assert manager.allocate_slots(request, 1)
    assert len(request.block_ids) == 2


def test_failed_allocation_changes_nothing() -> None:
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    holder = make_request("holder", list(range(8)))
    assert admit(manager, holder)
    compute_all(manager, holder)
    manager.free(holder)  # its two full blocks stay cached (evictable)
    free_before, cached_before = manager.num_free_blocks, first_block_ids(manager, list(range(8)))

    request = make_request("big", list(range(8)) + [9] * 8)  # hits 2 blocks, needs 2 more: only 1 left
    block_ids, num_cached = manager.get_computed_blocks(request)
    assert num_cached == 8
    assert not manager.allocate_slots(request, request.num_tokens - num_cached, block_ids)

    assert request.block_ids == []
    assert (manager.num_free_blocks, first_block_ids(manager, list(range(8)))) == (free_before, cached_before)
    assert all(manager.ref_count(b) == 0 for b in block_ids)


def test_repeated_prefix_hits_full_blocks_only() -> None:
    manager = BlockManager(num_blocks=20, block_size=BLOCK_SIZE)
    first = make_request("first", list(range(10)))  # blocks [0..3], [4..7] full; [8, 9] partial
    assert admit(manager, first)
    compute_all(manager, first)

    second = make_request("second", list(range(10)) + [42])
    block_ids, num_cached = manager.get_computed_blocks(second)
    assert block_ids == first.block_ids[:2]
    assert num_cached == 8


def test_cache_hit_leaves_at_least_one_token_to_compute() -> None:
    manager = BlockManager(num_blocks=20, block_size=BLOCK_SIZE)
    first = make_request("first", list(range(8)))
    assert admit(manager, first)
    compute_all(manager, first)

    same = make_request("same", list(range(8)))  # both blocks cached, but logits need a computed token
    block_ids, num_cached = manager.get_computed_blocks(same)
    assert num_cached == 4 <= same.num_tokens - 1
    assert block_ids == first.block_ids[:1]


def test_a_block_matches_only_under_the_same_prefix() -> None:
    manager = BlockManager(num_blocks=20, block_size=BLOCK_SIZE)
    first = make_request("first", [1, 1, 1, 1, 2, 2, 2, 2, 0])
    assert admit(manager, first)
    compute_all(manager, first)

    other = make_request("other", [3, 3, 3, 3, 2, 2, 2, 2, 0])  # same second block, other first block
    assert manager.get_computed_blocks(other) == ([], 0)


def test_identical_embeddings_share_cached_blocks() -> None:
    manager = BlockManager(num_blocks=20, block_size=BLOCK_SIZE)
    prompt = [TokenSegment([1, 2]), embedding(["x", "y", "z", "w"]), TokenSegment([3, 4, 5])]
    first = make_request("first", prompt)
    assert admit(manager, first)
    compute_all(manager, first)

    again = make_request(
        "again", [TokenSegment([1, 2]), embedding(["x", "y", "z", "w"]), TokenSegment([3, 4, 5])]
    )
    block_ids, num_cached = manager.get_computed_blocks(again)
    assert (block_ids, num_cached) == (first.block_ids[:2], 8)


def test_different_embedding_digests_miss() -> None:
    manager = BlockManager(num_blocks=20, block_size=BLOCK_SIZE)
    first = make_request("first", [embedding(["a", "b", "c", "d"]), TokenSegment([1])])
    assert admit(manager, first)
    compute_all(manager, first)

    other = make_request("other", [embedding(["a", "b", "c", "OTHER"]), TokenSegment([1])])
    assert manager.get_computed_blocks(other) == ([], 0)


def test_an_embedding_never_matches_a_token_id_sequence() -> None:
    manager = BlockManager(num_blocks=20, block_size=BLOCK_SIZE)
    first = make_request("first", [0, 0, 0, 0, 1])  # embedding positions carry token id 0 too
    assert admit(manager, first)
    compute_all(manager, first)

    rows = make_request("rows", [embedding(["a", "b", "c", "d"]), TokenSegment([1])])
    assert manager.get_computed_blocks(rows) == ([], 0)
    # Not even a digest spelling the token's own encoding collides: keys are tagged.
    assert hash_block(None, [5]) != hash_block(None, [("e", (5).to_bytes(8, "little"))])
    assert hash_block(None, [5]) != hash_block(None, [("e", b"t" + (5).to_bytes(8, "little"))])


def test_freed_blocks_stay_cached_and_a_hit_revives_them() -> None:
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    first = make_request("first", list(range(8)))
    assert admit(manager, first)
    compute_all(manager, first)
    manager.free(first)
    assert manager.num_free_blocks == 9  # evictable blocks count as free
    assert len(first_block_ids(manager, list(range(8)))) == 2

    again = make_request("again", list(range(8)) + [99])
    assert admit(manager, again)
    assert again.block_ids[:2] == first_block_ids(manager, list(range(8)))
    assert manager.ref_count(again.block_ids[0]) == 1
    assert manager.num_free_blocks == 9 - 3
    assert (manager.num_prefix_queries_tokens, manager.num_prefix_hits_tokens) == (8 + 9, 8)


def first_block_ids(manager: BlockManager, prompt: list[int]) -> list[int]:
    probe = make_request("probe", prompt + [0])
    return manager.get_computed_blocks(probe)[0]


def test_evictable_blocks_are_reused_least_recently_freed_first_tail_first() -> None:
    manager = BlockManager(num_blocks=7, block_size=BLOCK_SIZE)  # 6 usable blocks
    old = make_request("old", list(range(8)))
    new = make_request("new", list(range(100, 108)))
    for request in (old, new):
        assert admit(manager, request)
        compute_all(manager, request)
    manager.free(old)  # freed first: least recently used
    manager.free(new)

    pressure = make_request("pressure", list(range(200, 212)))  # 3 blocks: 2 never used, then 1 evicted
    assert admit(manager, pressure)

    assert len(first_block_ids(manager, list(range(8)))) == 1  # old's tail block went first
    assert len(first_block_ids(manager, list(range(100, 108)))) == 2  # new is untouched


def test_revived_blocks_are_not_evicted_while_held() -> None:
    manager = BlockManager(num_blocks=5, block_size=BLOCK_SIZE)  # 4 usable blocks
    first = make_request("first", list(range(8)))
    assert admit(manager, first)
    compute_all(manager, first)
    manager.free(first)
    holder = make_request("holder", list(range(8)) + [9])  # revives both blocks, adds one
    assert admit(manager, holder)

    assert manager.num_free_blocks == 1
    assert admit(manager, make_request("filler", [7]))
    assert not admit(manager, make_request("more", [7]))
    assert first_block_ids(manager, list(range(8))) == holder.block_ids[:2]


def test_duplicate_content_is_cached_once_and_the_copy_is_recycled_first() -> None:
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    a, b = make_request("a", list(range(5))), make_request("b", list(range(5)))
    for request in (a, b):  # admitted in the same step: neither can hit the other yet
        assert admit(manager, request)
    for request in (a, b):
        compute_all(manager, request)
    assert first_block_ids(manager, list(range(4))) == a.block_ids[:1]  # b's copy is not registered
    manager.free(b)
    assert manager.allocate_slots(make_request("c", [1]), 1)
    assert first_block_ids(manager, list(range(4))) == a.block_ids[:1]


def test_disabled_prefix_caching_never_hits() -> None:
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    first = make_request("first", list(range(8)))
    assert admit(manager, first)
    compute_all(manager, first)
    assert manager.get_computed_blocks(make_request("again", list(range(9)))) == ([], 0)


# Operations for the random test: (kind, request index, token choice).
operations = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "free"]), st.integers(0, 5), st.integers(0, 3)), max_size=60
)


@settings(max_examples=150, deadline=None)
@given(operations, st.integers(2, 12), st.integers(1, 4), st.booleans())
def test_random_allocate_and_free_keep_block_accounting(
    ops: list[tuple[str, int, int]], num_blocks: int, block_size: int, prefix_caching: bool
) -> None:
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    live: dict[int, Request] = {}
    for kind, index, choice in ops:
        request = live.get(index)
        if kind == "admit" and request is None:
            # Few distinct prompts, so prefixes repeat and the cache gets hit.
            prompt = [choice % 2] * (block_size * (choice + 1)) + [index]
            request = make_request(f"r{index}", prompt)
            if admit(manager, request):
                live[index] = request
        elif kind == "grow" and request is not None:
            # Only positions that have slots can have been computed (a failed grow left one without).
            request.num_computed_tokens = min(request.num_tokens, len(request.block_ids) * block_size)
            manager.cache_full_blocks(request)
            request.output_token_ids.append(choice)
            free_before, table_before = manager.num_free_blocks, list(request.block_ids)
            if not manager.allocate_slots(request, 1):
                assert (manager.num_free_blocks, request.block_ids) == (free_before, table_before)
        elif kind == "free" and request is not None:
            manager.free(live.pop(index))

        holders = Counter(b for r in live.values() for b in r.block_ids)
        assert 0 not in holders
        assert all(manager.ref_count(b) == holders[b] >= 0 for b in range(1, num_blocks))
        assert manager.num_free_blocks + len(holders) == manager.num_total_blocks
        assert 0.0 <= manager.usage <= 1.0
        assert manager.num_prefix_hits_tokens <= manager.num_prefix_queries_tokens

    for request in live.values():
        manager.free(request)
    assert manager.num_free_blocks == manager.num_total_blocks


def test_requests_of_different_adapters_never_share_blocks_and_of_one_adapter_do() -> None:
    manager = BlockManager(num_blocks=20, block_size=BLOCK_SIZE)
    first = make_request("first", list(range(10)))
    first.cache_salt = b"adapter-a"
    assert admit(manager, first)
    compute_all(manager, first)
    for salt, num_cached in ((b"", 0), (b"adapter-b", 0), (b"adapter-a", 8)):
        second = make_request("second", list(range(10)) + [42])
        second.cache_salt = salt
        assert manager.get_computed_blocks(second)[1] == num_cached, salt
