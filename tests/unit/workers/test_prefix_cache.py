"""Prefix cache: chained block keys, longest-prefix lookup, LRU eviction by bytes, counters.

That a hit gives the same tokens as a miss on the real model is checked in
tests/integration/test_lm_model.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.prefix_cache import PrefixCache


def block(value: float, nbytes: int = 64) -> np.ndarray:
    return np.full(nbytes // 4, value, np.float32)


def test_keys_cover_the_whole_prefix() -> None:
    cache = PrefixCache(max_bytes=1 << 20, block_tokens=4)
    a = cache.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = cache.block_hashes([1, 2, 3, 4, 5, 6, 7, 8])
    c = cache.block_hashes([0, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and a == b  # the partial trailing block has no key
    assert c[1] != a[1]  # same second block, different parent: different key
    assert PrefixCache(1 << 20, 4, namespace="int8").block_hashes([1, 2, 3, 4]) != a[:1]


def test_lookup_returns_the_longest_cached_run_and_counts() -> None:
    cache = PrefixCache(max_bytes=1 << 20, block_tokens=2)
    keys = cache.block_hashes([1, 2, 3, 4, 5, 6])
    cache.insert(keys[0], block(0))
    cache.insert(keys[2], block(2))  # unreachable without keys[1]
    found = cache.lookup(keys)
    assert [float(v[0]) for v in found] == [0.0]
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.entries, stats.bytes) == (1, 2, 2, 128)


def test_lru_eviction_by_bytes() -> None:
    cache = PrefixCache(max_bytes=192, block_tokens=1)
    k = cache.block_hashes([1, 2, 3, 4])
    for i in range(3):
        cache.insert(k[i], block(i))
    cache.lookup(k[:1])  # k0 is now the most recently used
    cache.insert(k[3], block(3))
    assert k[1] not in cache and all(x in cache for x in (k[0], k[2], k[3]))
    assert cache.stats.evictions == 1 and cache.stats.bytes == 192
    cache.insert(k[1], np.zeros(1000, np.float32))  # larger than the whole cache: not stored
    assert k[1] not in cache and cache.stats.bytes == 192


def test_invalid_limits() -> None:
    with pytest.raises(ValueError):
        PrefixCache(max_bytes=10, block_tokens=0)


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40)), max_size=60), st.integers(0, 600))
def test_never_over_budget(ops: list[tuple[int, int]], max_bytes: int) -> None:
    cache = PrefixCache(max_bytes=max_bytes, block_tokens=1)
    keys = cache.block_hashes(list(range(6)))
    for key, floats in ops:
        cache.insert(keys[key], np.zeros(floats, np.float32))
        assert cache.stats.bytes <= max_bytes
        assert cache.stats.bytes == sum(cache._blocks[k].nbytes for k in cache._blocks)


def test_prompts_of_different_tenants_never_share_a_block():
    """A hit shows in the result's cached-token count: it must not tell one tenant what another sent."""
    cache = PrefixCache(1 << 20, 4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    a, b = cache.block_hashes(tokens, "acme"), cache.block_hashes(tokens, "globex")
    assert not set(a) & set(b)
    assert cache.block_hashes(tokens, "acme") == a and cache.block_hashes(tokens) == cache.block_hashes(tokens, "")
