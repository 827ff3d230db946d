"""The embedding cache: an input's rows are found again only for the same model, kind, content and
dtype, and the cache never holds more bytes than its bound, the least recently used going first."""

from __future__ import annotations

import torch

from tandem.decoder.api.embedding_cache import EmbeddingCache, cache_key


def test_a_key_tells_apart_every_model_kind_content_and_dtype() -> None:
    base = cache_key("llava", "text", "a cat", torch.bfloat16)
    assert cache_key("llava", "text", "a cat", torch.bfloat16) == base
    others = [
        cache_key("llava-2", "text", "a cat", torch.bfloat16),
        cache_key("llava", "image", b"a cat", torch.bfloat16),
        cache_key("llava", "text", "a cat ", torch.bfloat16),
        cache_key("llava", "text", "a cat", torch.float32),
        cache_key("llavat", "ext", "a cat", torch.bfloat16),  # labels cannot run into each other
    ]
    assert len({base, *others}) == 1 + len(others)
    assert cache_key("m", "token_ids", [1, 2], torch.float32) != cache_key(
        "m", "token_ids", [2, 1], torch.float32
    )


def test_the_least_recently_used_rows_go_first_within_the_bound() -> None:
    cache = EmbeddingCache(max_bytes=3 * 4 * 16)  # three [4, 4] float32 entries
    rows = {name: torch.full((4, 4), float(i)) for i, name in enumerate("abcd")}
    for name in "abc":
        cache.put(name.encode(), rows[name])
    assert cache.get(b"a") is rows["a"]  # now b is the least recently used
    cache.put(b"d", rows["d"])
    assert cache.get(b"b") is None and cache.get(b"c") is rows["c"] and cache.get(b"d") is rows["d"]
    assert cache.num_bytes == 3 * 64 and len(cache) == 3 and cache.num_hits == 3


def test_rows_larger_than_the_bound_are_not_kept_and_a_zero_bound_keeps_nothing() -> None:
    cache = EmbeddingCache(max_bytes=64)
    cache.put(b"big", torch.zeros(5, 4))
    assert cache.get(b"big") is None and cache.num_bytes == 0
    off = EmbeddingCache(max_bytes=0)
    off.put(b"any", torch.zeros(1, 1))
    assert len(off) == 0
