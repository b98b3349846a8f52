"""The reuse-cache wrapper's bookkeeping (no Redis here: a dict stands in for the store,
because what is tested is which jobs run and what each slot gets back)."""

import numpy as np

from schemas.jobs import EncodeJob
from streams.metrics import Metrics
from workers.cache import CachingBatch


class DictCache:
    def __init__(self, up=True):
        self.store, self.up = {}, up

    def get_many(self, keys):
        return [self.store.get(k) for k in keys] if self.up else None

    def set_many(self, items):
        if self.up:
            self.store.update(items)
        return self.up


def job(i, text):
    return EncodeJob(id=f"r{i}", part=0, n_parts=1, modality="text", lane="rt", tenant="t", deadline_at_ms=1e18,
                     sent_at_ms=0, text=text)


def make(cache):
    calls = []

    def run(jobs):
        calls.append([j.text for j in jobs])
        return [np.full(4, len(j.text), dtype=np.float32) if j.text != "boom" else ValueError("bad") for j in jobs]

    return CachingBatch(run, lambda j: None if j.text == "nocache" else f"k:{j.text}", cache, Metrics(), "text"), calls


def test_identical_misses_run_once_and_later_hits_skip_the_engine():
    cache = DictCache()
    batch, calls = make(cache)
    out = batch([job(1, "aa"), job(2, "aa"), job(3, "bbb"), job(4, "nocache")])
    assert calls == [["aa", "bbb", "nocache"]]
    assert [o.cache for o in out] == ["miss", "miss", "miss", None]
    again = batch([job(5, "bbb"), job(6, "aa")])
    assert calls == [["aa", "bbb", "nocache"]]  # nothing ran
    assert [o.cache for o in again] == ["hit", "hit"]
    assert np.array_equal(again[0].embedding.astype(np.float32), out[2].embedding.astype(np.float32))


def test_errors_are_not_cached_and_stay_per_item():
    cache = DictCache()
    batch, calls = make(cache)
    out = batch([job(1, "boom"), job(2, "ok")])
    assert isinstance(out[0], ValueError) and out[1].cache == "miss"
    assert "k:boom" not in cache.store


def test_cache_down_only_costs_time():
    batch, calls = make(DictCache(up=False))
    out = batch([job(1, "aa"), job(2, "aa")])
    assert [float(o.embedding[0]) for o in out] == [2.0, 2.0] and calls == [["aa"]]
