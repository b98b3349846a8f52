"""Stand-ins the encoder core's and the encode stage's unit tests share: a dict for the reuse
cache (what ``workers.cache.CacheFront`` talks to) and an observer that records nothing."""

from __future__ import annotations


class DictCache:
    """The reuse cache's store: every key not in ``store`` is a miss this caller may claim."""

    def __init__(self, store=None):
        self.store = dict(store or {})

    def lookup_or_claim(self, keys, hold_ms):
        return [self.store.get(k, True) for k in keys]

    def get_many(self, keys):
        return [self.store.get(k) for k in keys]

    def set_many(self, items):
        self.store.update(items)
        return True


class Quiet:
    """Observes nothing: the reuse cache's lookups, the core's queue depths and batches."""

    def cache_lookup(self, modality, result):
        pass

    def queue_depth(self, lane, depth):
        pass

    def batch(self, answers, started, finished):
        pass
