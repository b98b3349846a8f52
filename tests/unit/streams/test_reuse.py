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


# -- candidate pools rescored against the new query ------------------------------------------

POOL = HITS + (H("d", 0.6), H("e", 0.5))


def pooled(pool_size: int = 5, threshold: float = 0.9) -> NearDuplicateCache:
    cache = NearDuplicateCache(threshold, 8, pool_size=pool_size)
    cache.store(Q, 3, None, HITS, POOL)
    return cache


def test_a_near_hit_with_rescore_is_answered_from_the_pool_for_the_new_query() -> None:
    cache = pooled()
    calls = []

    def rescore(doc_ids, query, k):
        calls.append((tuple(doc_ids), k))
        return [H("e", 0.97), H("a", 0.9), H("d", 0.8)]

    near = rotated(Q, 0.95)
    assert cache.lookup(near, 3, None, rescore) == (H("e", 0.97), H("a", 0.9), H("d", 0.8))
    assert calls == [(("a", "b", "c", "d", "e"), 3)]
    assert cache.lookup(near, 3) == HITS  # no rescore: the stored hits as they are
    assert cache.lookup(rotated(Q, 0.85), 3, None, rescore) is None
    assert (cache.hits, cache.misses, len(calls)) == (2, 1, 1)


def test_the_pool_is_cut_to_pool_size_but_never_below_k() -> None:
    cache = pooled(pool_size=4)
    seen = []
    cache.lookup(Q, 3, None, lambda d, q, k: seen.append(tuple(d)) or [])
    assert seen == [("a", "b", "c", "d")]
    small = NearDuplicateCache(0.9, 8, pool_size=1)
    small.store(Q, 3, None, HITS, POOL)
    small.lookup(Q, 3, None, lambda d, q, k: seen.append(tuple(d)) or [])
    assert seen[-1] == ("a", "b", "c")


def test_upsert_of_a_pool_member_outside_the_hits_invalidates() -> None:
    cache = pooled()
    assert cache.invalidate_upsert("e", unit(0, 0, 0, 1)) == 1  # far now, but its rescored score moved
    assert cache.lookup(Q, 3) is None


def test_upsert_reaching_the_pools_floor_invalidates_and_below_it_keeps() -> None:
    cache = pooled()
    assert cache.invalidate_upsert("new", rotated(Q, 0.49)) == 0  # under the pool's worst, 0.5
    assert cache.lookup(Q, 3) == HITS
    assert cache.invalidate_upsert("new", rotated(Q, 0.55)) == 1  # under the 3rd hit, but joins the pool
    assert cache.lookup(Q, 3) is None


def test_a_pool_shorter_than_asked_is_changed_by_any_admitted_upsert() -> None:
    cache = NearDuplicateCache(0.9, 8, pool_size=10)
    cache.store(Q, 3, {"lang": "en"}, HITS, POOL)  # 5 of 10: the filter admitted only these
    assert cache.invalidate_upsert("far", unit(-1, 0, 0, 0), {"lang": "de"}) == 0
    assert cache.invalidate_upsert("far", unit(-1, 0, 0, 0), {"lang": "en"}) == 1


def test_delete_of_a_pool_member_invalidates() -> None:
    cache = pooled()
    assert cache.invalidate_delete("zzz") == 0
    assert cache.invalidate_delete("d") == 1
    assert len(cache) == 0


def test_bad_pool_size_is_refused() -> None:
    with pytest.raises(ValueError):
        NearDuplicateCache(0.9, 4, pool_size=-1)


def test_invalidation_keeps_every_live_pool_equal_to_a_fresh_search() -> None:
    """The promise, on an exact index: after any run of upserts and deletes, each entry the
    cache kept still holds the pool a search of its query would give now."""
    rng = np.random.default_rng(7)
    dim, k, n = 8, 3, 6

    def rand() -> np.ndarray:
        v = rng.standard_normal(dim).astype(np.float32)
        return v / np.linalg.norm(v)

    docs = {f"d{i}": (rand(), {"lang": "en" if i % 2 else "de"}) for i in range(60)}

    def pool_of(q: np.ndarray, where) -> list[H]:
        scored = [H(d, float(np.float32(v @ q))) for d, (v, m) in docs.items() if admits(where, m)]
        return sorted(scored, key=lambda h: (-h.score, h.doc_id))[:n]

    cache = NearDuplicateCache(0.99, 64, pool_size=n)
    queries = []
    for step in range(400):
        if step % 4 == 0:
            q, where = rand(), [None, {"lang": "en"}][step % 8 == 0]
            pool = pool_of(q, where)
            cache.store(q, k, where, pool[:k], pool)
            queries.append((q, where))
        elif step % 4 == 1:
            victim = f"d{rng.integers(80)}"
            if victim in docs:
                del docs[victim]
                cache.invalidate_delete(victim)
        else:
            d = f"d{rng.integers(80)}"
            docs[d] = (rand(), {"lang": ["en", "de"][int(rng.integers(2))]})
            cache.invalidate_upsert(d, docs[d][0], docs[d][1] if step % 3 else None)
        for q, where in queries:
            got = cache.lookup(q, k, where, lambda ids, qq, kk: tuple(ids))
            if got is not None:
                assert set(got) == {h.doc_id for h in pool_of(q, where)}
    assert cache.invalidations > 0


def test_the_cache_adds_no_garbage_collected_objects_per_pooled_document() -> None:
    """A full collection walks every tracked object: a set per pooled document made 56k of
    them at 100k passages (docs/retrieval.md). Its bookkeeping grows with entries only."""
    import gc
    from typing import NamedTuple

    class C(NamedTuple):
        doc_id: str
        score: float

    rng = np.random.default_rng(5)
    cache = NearDuplicateCache(0.99, 64, pool_size=100)
    gc.collect()
    before = len(gc.get_objects())
    for e in range(50):  # 50 entries, 100 distinct documents in each pool
        q = rng.standard_normal(8).astype(np.float32)
        pool = [C(f"d{e}-{i}", 1.0 - i / 200) for i in range(100)]
        cache.store(q / np.linalg.norm(q), 3, None, pool[:3], pool)
    gc.collect()
    assert len(gc.get_objects()) - before < 600  # 5000 pooled documents
    cache.invalidate_delete("d7-50")
    assert cache.invalidations == 1 and "d7-50" not in cache._by_doc and "d7-0" not in cache._by_doc
