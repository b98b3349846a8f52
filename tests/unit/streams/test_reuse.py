"""NearDuplicateCache: threshold hits, key by (k, filter), LRU bound, exact invalidation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from streams.policies.reuse import NearDuplicateCache, admits, where_key


@dataclass(frozen=True)
class H:
    doc_id: str
    score: float


def unit(*values: float) -> np.ndarray:
    v = np.array(values, dtype=np.float32)
    return v / np.linalg.norm(v)


def rotated(base: np.ndarray, cosine: float) -> np.ndarray:
    """A unit vector at exactly ``cosine`` from ``base`` (a unit vector along axis 0)."""
    other = np.zeros_like(base)
    other[1] = 1.0
    return cosine * base + np.sqrt(1 - cosine ** 2) * other


Q = unit(1, 0, 0, 0)
HITS = (H("a", 0.9), H("b", 0.8), H("c", 0.7))


def cache_with(threshold: float = 0.95, **kw) -> NearDuplicateCache:
    cache = NearDuplicateCache(threshold, kw.pop("max_entries", 8))
    cache.store(Q, 3, None, HITS)
    return cache


def test_a_query_within_the_threshold_is_answered_from_the_cache() -> None:
    cache = cache_with(0.95)
    assert cache.lookup(rotated(Q, 0.96), 3) == HITS
    assert cache.lookup(rotated(Q, 0.94), 3) is None
    assert cache.lookup(Q * 5.0, 3) == HITS  # scale does not matter
    assert (cache.hits, cache.misses) == (2, 1)


def test_another_k_or_filter_misses() -> None:
    cache = cache_with()
    cache.store(Q, 3, {"lang": "en"}, (H("x", 0.5),))
    assert cache.lookup(Q, 5) is None
    assert cache.lookup(Q, 3, {"lang": "de"}) is None
    assert cache.lookup(Q, 3, {"lang": "en"}) == (H("x", 0.5),)
    assert cache.lookup(Q, 3, {}) == HITS  # no filter and an empty one are the same


def test_filter_keys_are_canonical() -> None:
    assert where_key({"a": [2, 1], "b": "x"}) == where_key({"b": "x", "a": (1, 2)})
    assert where_key({"a": 1}) != where_key({"a": True})
    assert where_key(None) == where_key({}) == ""


def test_the_closest_cached_query_answers() -> None:
    cache = cache_with(0.9)
    near = rotated(Q, 0.99)
    cache.store(near, 3, None, (H("z", 0.99),))
    assert cache.lookup(rotated(Q, 0.991), 3) == (H("z", 0.99),)  # 0.99999 to near, 0.991 to Q
    assert cache.lookup(rotated(Q, 0.999), 3) == HITS


def test_lru_bound_evicts_the_least_recently_used() -> None:
    cache = NearDuplicateCache(0.99, max_entries=2)
    a, b, c = unit(1, 0, 0, 0), unit(0, 1, 0, 0), unit(0, 0, 1, 0)
    cache.store(a, 1, None, (H("a", 1.0),))
    cache.store(b, 1, None, (H("b", 1.0),))
    assert cache.lookup(a, 1) is not None  # a is now the most recent
    cache.store(c, 1, None, (H("c", 1.0),))
    assert len(cache) == 2 and cache.evictions == 1
    assert cache.lookup(b, 1) is None
    assert cache.lookup(a, 1) is not None and cache.lookup(c, 1) is not None


def test_upsert_of_a_listed_doc_invalidates() -> None:
    cache = cache_with()
    assert cache.invalidate_upsert("b", unit(0, 0, 0, 1)) == 1  # listed: its score moved, even far away
    assert cache.lookup(Q, 3) is None and cache.invalidations == 1


def test_upsert_reaching_the_kth_score_invalidates_and_below_it_keeps() -> None:
    cache = cache_with()
    assert cache.invalidate_upsert("new", rotated(Q, 0.69)) == 0  # below the 3rd score 0.7: cannot enter
    assert cache.lookup(Q, 3) == HITS
    assert cache.invalidate_upsert("new", rotated(Q, 0.71)) == 1  # above it: would enter the top 3
    assert cache.lookup(Q, 3) is None


def test_upsert_invalidates_only_the_entries_it_reaches() -> None:
    cache = NearDuplicateCache(0.99, 8)
    other = unit(0, 0, 1, 0)
    cache.store(Q, 3, None, HITS)
    cache.store(other, 3, None, (H("p", 0.9), H("q", 0.85), H("r", 0.8)))
    assert cache.invalidate_upsert("new", rotated(Q, 0.95)) == 1
    assert cache.lookup(Q, 3) is None
    assert cache.lookup(other, 3) is not None


def test_an_answer_shorter_than_k_is_changed_by_any_admitted_upsert() -> None:
    cache = NearDuplicateCache(0.99, 8)
    cache.store(Q, 3, {"lang": "en"}, (H("a", 0.9),))
    assert cache.invalidate_upsert("far", unit(-1, 0, 0, 0), {"lang": "de"}) == 0  # not admitted
    assert cache.invalidate_upsert("far", unit(-1, 0, 0, 0), {"lang": "en"}) == 1


def test_upsert_outside_an_entrys_filter_keeps_it_unless_listed() -> None:
    cache = NearDuplicateCache(0.99, 8)
    cache.store(Q, 3, {"lang": "en"}, HITS)
    assert cache.invalidate_upsert("x", Q, {"lang": "de"}) == 0
    assert cache.invalidate_upsert("x", Q) == 1  # meta unknown: taken as admitted
    cache.store(Q, 3, {"lang": "en"}, HITS)
    assert cache.invalidate_upsert("a", Q, {"lang": "de"}) == 1  # listed, now filtered out


def test_delete_invalidates_exactly_the_entries_listing_the_doc() -> None:
    cache = NearDuplicateCache(0.99, 8)
    other = unit(0, 0, 1, 0)
    cache.store(Q, 3, None, HITS)
    cache.store(other, 3, None, (H("p", 0.9), H("q", 0.85), H("r", 0.8)))
    assert cache.invalidate_delete("zzz") == 0
    assert cache.invalidate_delete("b") == 1
    assert cache.lookup(Q, 3) is None and cache.lookup(other, 3) is not None
    assert cache.invalidations == 1


def test_slots_freed_by_invalidation_are_reused() -> None:
    cache = NearDuplicateCache(0.99, 2)
    for i in range(10):
        cache.store(Q, 3, None, HITS)
        cache.invalidate_delete("a")
    assert len(cache) == 0 and cache.evictions == 0


def test_admits_follows_the_index_filter() -> None:
    assert admits({"lang": ["en", "de"]}, {"lang": "de"})
    assert not admits({"lang": "en"}, {})
    assert not admits({"flag": True}, {"flag": 1})
    assert not admits({"tags": "a"}, {"tags": ["a"]})
    assert admits(None, {"anything": 1})


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        NearDuplicateCache(0.0, 4)
    with pytest.raises(ValueError):
        NearDuplicateCache(0.9, 0)
    cache = cache_with()
    with pytest.raises(ValueError):
        cache.store(unit(1, 0), 3, None, HITS)
    with pytest.raises(ValueError):
        cache.lookup(np.zeros(4), 3)
