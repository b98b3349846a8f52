"""The reuse-cache wrapper's bookkeeping (no Redis here: a dict stands in for the store,
because what is tested is which jobs run and what each slot gets back)."""

import time

import numpy as np

from schemas.jobs import EncodeJob
from streams.metrics import Metrics
from workers.cache import CachingBatch, pack_output


class DictCache:
    def __init__(self, up=True):
        self.store, self.up, self.claims = {}, up, set()

    def claim(self, keys, hold_ms):
        mine = [k not in self.claims for k in keys]
        self.claims.update(keys)
        return mine

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


def test_a_miss_another_replica_is_computing_is_waited_for_not_recomputed():
    cache = DictCache()
    cache.claims.add("k:aa")  # another replica claimed it a moment ago
    polls = []

    def sleep(_s):  # the other replica's answer lands after the second poll
        polls.append(_s)
        if len(polls) == 2:
            cache.store["k:aa"] = pack_output(np.full(4, 9.0, dtype=np.float32), {}, "float16")

    batch, calls = make(cache)
    batch.sleep = sleep
    out = batch([job(1, "aa"), job(2, "bbb")])
    assert calls == [["bbb"]]  # aa was not computed here
    assert out[0].cache == "hit" and float(out[0].embedding[0]) == 9.0


def test_a_claimed_miss_that_never_appears_is_computed_after_the_wait():
    cache = DictCache()
    cache.claims.add("k:aa")
    batch, calls = make(cache)
    batch.wait_ms, batch.poll_ms, batch.sleep = 5.0, 1.0, time.sleep
    out = batch([job(1, "aa")])
    assert calls == [["aa"]] and out[0].cache == "miss"
