"""The reuse cache's bookkeeping around an encoder (no Redis here: a dict stands in for the
store, because what is tested is which jobs reach the engine and what each job gets back)."""

import time

import numpy as np

from schemas.jobs import EncodeJob
from streams.observe.metrics import Metrics
from workers.cache import CacheFront, pack_output
from workers.encoders import EncoderFront, Runner
from workers.outputs import Encoded, Prepared


class DictCache:
    def __init__(self, up=True):
        self.store, self.up, self.claims = {}, up, set()

    def lookup_or_claim(self, keys, hold_ms):
        if not self.up:
            return None
        out = []
        for k in keys:
            if k in self.store:
                out.append(self.store[k])
            else:
                out.append(k not in self.claims)
                self.claims.add(k)
        return out

    def get_many(self, keys):
        return [self.store.get(k) for k in keys] if self.up else None

    def set_many(self, items):
        if self.up:
            self.store.update(items)
        return self.up


def job(i, text):
    return EncodeJob(id=f"r{i}", part=0, n_parts=1, modality="text", lane="rt", tenant="t", deadline_at_ms=1e18,
                     sent_at_ms=0, text=text)


def make(cache, **front):
    calls = []

    def prepare(j):
        if j.text == "unreadable":
            raise ValueError("cannot prepare")
        return Prepared(j, float(len(j.text)), j.text, content=None if j.text == "nocache" else j.text.encode())

    def run(items):
        calls.append([i.data for i in items])
        return [np.full(4, len(i.data), dtype=np.float32) if i.data != "boom" else ValueError("bad") for i in items]

    cache_front = CacheFront(cache, Metrics(), "text", **front)
    return EncoderFront(Runner(prepare, run), None, cache_front, key_of=lambda j, content: f"k:{content.decode()}"), calls


def flow(front, jobs):
    """What the encode stage does: prepare (with lookups), run what missed, store what ran."""
    out = front.prepare_many(jobs)
    todo = [i for i, o in enumerate(out) if isinstance(o, Prepared)]
    results = front.run([out[i] for i in todo]) if todo else []
    for i, r in zip(todo, results):
        key = out[i].key
        if isinstance(r, Encoded) and key is not None:
            front.store([(key, r)])
            r = Encoded(r.embedding, r.extras, cache="miss")
        out[i] = r
    return out


def test_identical_misses_run_once_and_later_hits_skip_the_engine():
    front, calls = make(DictCache())
    out = flow(front, [job(1, "aa"), job(2, "aa"), job(3, "bbb"), job(4, "nocache")])
    assert calls == [["aa", "bbb", "nocache"]]
    assert [o.cache for o in out] == ["miss", "miss", "miss", None]
    again = flow(front, [job(5, "bbb"), job(6, "aa")])
    assert calls == [["aa", "bbb", "nocache"]]  # nothing ran
    assert [o.cache for o in again] == ["hit", "hit"]
    assert np.array_equal(again[0].embedding.astype(np.float32), out[2].embedding.astype(np.float32))


def test_errors_are_not_cached_and_stay_per_item():
    cache = DictCache()
    front, calls = make(cache)
    out = flow(front, [job(1, "boom"), job(2, "ok"), job(3, "unreadable")])
    assert isinstance(out[0], ValueError) and out[1].cache == "miss" and isinstance(out[2], ValueError)
    assert "k:boom" not in cache.store and calls == [["boom", "ok"]]


def test_cache_down_only_costs_time():
    front, calls = make(DictCache(up=False))
    out = flow(front, [job(1, "aa"), job(2, "aa")])
    assert [float(o.embedding[0]) for o in out] == [2.0, 2.0] and calls == [["aa"]]


def test_a_miss_another_replica_is_computing_is_waited_for_not_recomputed():
    cache = DictCache()
    cache.claims.add("k:aa")  # another replica claimed it a moment ago
    polls = []

    def sleep(_s):  # the other replica's answer lands after the second poll
        polls.append(_s)
        if len(polls) == 2:
            cache.store["k:aa"] = pack_output(np.full(4, 9.0, dtype=np.float32), {}, "float16")

    front, calls = make(cache, sleep=sleep)
    out = flow(front, [job(1, "aa"), job(2, "bbb")])
    assert calls == [["bbb"]]  # aa was not computed here
    assert out[0].cache == "hit" and float(out[0].embedding[0]) == 9.0


def test_a_claimed_miss_that_never_appears_is_computed_after_the_wait():
    cache = DictCache()
    cache.claims.add("k:aa")
    front, calls = make(cache, wait_ms=5.0, poll_ms=1.0, sleep=time.sleep)
    out = flow(front, [job(1, "aa")])
    assert calls == [["aa"]] and out[0].cache == "miss"
