"""Near-duplicate result reuse for retrieval (the Proximity-style cache, DESIGN.md Retrieval).

``NearDuplicateCache`` remembers (query vector, k, filter, hits, candidate pool) of one index
— one cache per (tenant, collection, index epoch): the stage drops a cache when its index is
rebuilt or its embedding model changes, and keeps it across ordinary upserts and deletes,
which invalidate exactly the entries they could change. A query whose cosine with a
remembered one (same k, same filter) is at least ``threshold`` is answered without a graph
walk: given a ``rescore`` function (``CollectionIndex.rescore``), by the best k of the
remembered query's candidate pool scored exactly against the NEW query; without one, by the
remembered hits as they are.

An entry's pool is the best ``max(k, pool_size)`` candidates of its search
(``CollectionIndex.search_with_pool``), or its hits when no pool was stored; its floor is the
pool's worst score, or -inf when the pool is shorter than asked (the filter admitted fewer
documents: then any admitted one would join it). The promise invalidation keeps: every live
entry's pool is what a search of its query would pool now, up to the graph's own error. An
upsert breaks it for an entry whose pool holds the document (its vector or meta moved), or
whose filter admits the document and whose floor the document's cosine with the cached query
reaches (it would join the pool). A delete breaks it for the entries whose pool holds the
document. Those entries are dropped; every other keeps its answer. Scores compared here are
the same float32 dot products the index computes, with a margin of ``SCORE_MARGIN`` toward
dropping.

Pure: numpy and the standard library, no clock; not thread-safe (one stage thread).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

DEFAULT_THRESHOLD = 0.80
"""For lookups given ``rescore`` (the pool answers the new query). Measured (docs/retrieval.md,
107k passages, retyped queries, MiniLM int8, pool 100): 0.80 answered 46.7% of a stream that
is half near-duplicates without a graph walk, recall@10 0.84 points lower (0.61 on a 19k
sample); 0.75 reached 48.4% at 1.23 points lower, 0.85 44.5% at 0.54 lower."""
HITS_ONLY_THRESHOLD = 0.99
"""For lookups without ``rescore`` (the stored hits answer as they are): the only value measured
within a point of recall (11-13% of searches avoided)."""
DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_POOL_SIZE = 200
"""Candidates kept per entry. Up to the index's ef (128) a wider pool costs no wider walk, only
its rescoring (tens of microseconds); 200 widens the walk (retrieve service p99 4.19 against
3.45-3.58 ms at 100k passages) and keeps recall where an unrelated query's pool answers: on a
100k run's own stream at 0.80, 52.5% of searches avoided at 0.51 points of recall@10, against
1.59 points with 100 (docs/retrieval.md)."""

SCORE_MARGIN = 1e-5
"""An upsert whose cosine is within this of an entry's k-th score invalidates it: float32
dot products in another order differ in the last bits."""


class ScoredHit(Protocol):
    """What the cache needs of a hit (``workers.retrieval.index.Hit`` is one)."""

    @property
    def doc_id(self) -> str: ...

    @property
    def score(self) -> float: ...


Rescore = Callable[[Sequence[str], np.ndarray, int], Sequence[Any]]
"""``rescore(doc_ids, query, k)``: the best ``k`` of ``doc_ids`` for ``query``, scored exactly
(``CollectionIndex.rescore`` with the request's filter bound)."""


@dataclass(frozen=True)
class _Entry:
    k: int
    where_key: str
    where: Mapping[str, Any] | None
    hits: tuple[Any, ...]
    pool: tuple[str, ...]
    """Doc ids of the candidate pool, best first (the hits' when no pool was stored)."""
    floor: float
    """The score a document must reach to join the pool (-inf when the pool is short)."""


def where_key(where: Mapping[str, Any] | None) -> str:
    """One string per filter meaning: keys sorted, any-of lists as sorted sets; {} is None."""
    if not where:
        return ""
    canon = {}
    for key, wanted in where.items():
        if isinstance(wanted, (list, tuple, set, frozenset)):
            canon[key] = sorted({json.dumps(_tagged(v), sort_keys=True, default=repr) for v in wanted})
        else:
            canon[key] = json.dumps(_tagged(wanted), sort_keys=True, default=repr)
    return json.dumps(canon, sort_keys=True)


def _tagged(value: Any) -> list[Any]:
    return [type(value).__name__ if isinstance(value, bool) else "", value]  # True and 1 are two filters


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def admits(where: Mapping[str, Any] | None, meta: Mapping[str, Any]) -> bool:
    """Whether ``where`` admits a document with ``meta``, as ``CollectionIndex`` filters:
    every key present with a scalar value equal to the wanted one (or to one of a list's),
    a bool never equal to an int."""
    for key, wanted in (where or {}).items():
        if key not in meta or not _scalar(meta[key]):
            return False
        value = meta[key]
        values = wanted if isinstance(wanted, (list, tuple, set, frozenset)) else (wanted,)
        if not any(_scalar(w) and isinstance(w, bool) == isinstance(value, bool) and w == value for w in values):
            return False
    return True


class NearDuplicateCache:
    """Hits of recent searches of one index, answered again for near-duplicate queries.

    ``threshold``: the cosine (0, 1] a query needs with a cached one. ``max_entries``: the
    most entries held; the least recently used goes first. ``pool_size``: the candidates kept
    per entry (at least its k; ask the index for this many, ``search_with_pool``).
    Counters: ``hits``, ``misses``, ``invalidations`` (entries an upsert or delete dropped),
    ``evictions``.
    """

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, max_entries: int = DEFAULT_MAX_ENTRIES,
                 pool_size: int = DEFAULT_POOL_SIZE) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        if pool_size < 0:
            raise ValueError(f"pool_size must not be negative, got {pool_size}")
        self.threshold = threshold
        self.max_entries = max_entries
        self.pool_size = pool_size
        self.hits = self.misses = self.invalidations = self.evictions = 0
        self._queries: np.ndarray | None = None        # (max_entries, dim) unit vectors, by slot
        self._floor = np.full(max_entries, np.inf, dtype=np.float32)
        self._live = np.zeros(max_entries, dtype=bool)
        self._group = np.full(max_entries, -1, dtype=np.int64)  # (k, where) group of each slot
        self._groups: dict[tuple[int, str], int] = {}
        self._entries: list[_Entry | None] = [None] * max_entries
        self._lru: OrderedDict[int, None] = OrderedDict()      # slots, least recently used first
        self._by_doc: dict[str, dict[int, None]] = {}
        """Doc id -> the entries whose pool holds it, as the keys of a dict: a dict of ints is
        not tracked by the garbage collector, a set always is (a set per pooled document made
        56k tracked objects at 100k passages: docs/retrieval.md)."""
        self._free = list(range(max_entries - 1, -1, -1))  # lowest first: slots in use stay below _high
        self._high = 0  # one past the highest slot ever taken: lookups scan only [0, _high)

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, query: np.ndarray, k: int, where: Mapping[str, Any] | None = None,
               rescore: Rescore | None = None) -> tuple[Any, ...] | None:
        """The answer for ``query`` from the closest cached query with the same ``k`` and
        filter, when its cosine with ``query`` reaches ``threshold``; else None (a miss).
        With ``rescore``, the answer is ``rescore(pool, query, k)`` (the entry's pool scored
        against this query); without, the entry's hits as they were stored."""
        group = self._groups.get((k, where_key(where)))
        if group is not None and self._queries is not None:
            q = self._unit(query)
            high = self._high
            sims = self._queries[:high] @ q
            sims[(self._group[:high] != group) | ~self._live[:high]] = -np.inf
            best = int(np.argmax(sims))
            if sims[best] >= self.threshold:
                self.hits += 1
                self._lru.move_to_end(best)
                entry = self._entries[best]
                assert entry is not None
                return entry.hits if rescore is None else tuple(rescore(entry.pool, query, k))
        self.misses += 1
        return None

    def store(self, query: np.ndarray, k: int, where: Mapping[str, Any] | None, hits: Sequence[ScoredHit],
              pool: Sequence[ScoredHit] | None = None) -> None:
        """Remembers ``hits`` (best first, as the index returned them) as the answer to
        ``query`` with ``k`` and ``where``, and ``pool`` (the search's candidates, best first,
        holding the hits: ``search_with_pool``'s second value; cut to ``max(k, pool_size)``)
        as what a near-duplicate's answer is rescored from; without ``pool``, the hits are the
        pool. Evicts the least recently used entry when full."""
        q = self._unit(query)
        if self._queries is None:
            self._queries = np.zeros((self.max_entries, len(q)), dtype=np.float32)
        elif self._queries.shape[1] != len(q):
            raise ValueError(f"query has {len(q)} values, cached ones {self._queries.shape[1]}")
        hits = tuple(hits)
        if pool is None:
            size, candidates = k, hits
        else:
            size = max(k, self.pool_size)
            candidates = tuple(pool[:size])
        floor = float(candidates[size - 1].score) if len(candidates) >= size else -math.inf
        ids = tuple(dict.fromkeys([h.doc_id for h in candidates] + [h.doc_id for h in hits]))
        if not self._free:
            self.evictions += 1
            self._drop(next(iter(self._lru)))
        slot = self._free.pop()
        self._high = max(self._high, slot + 1)
        wkey = where_key(where)
        group = self._groups.setdefault((k, wkey), len(self._groups))
        self._entries[slot] = _Entry(k, wkey, dict(where) if where else None, hits, ids, floor)
        self._queries[slot] = q
        self._floor[slot] = floor
        self._group[slot] = group
        self._live[slot] = True
        self._lru[slot] = None
        for doc_id in ids:
            self._by_doc.setdefault(doc_id, {})[slot] = None

    def invalidate_upsert(self, doc_id: str, vector: np.ndarray, meta: Mapping[str, Any] | None = None) -> int:
        """Drops the entries the upsert of ``doc_id`` (its new ``vector``; its new ``meta``
        when known, else any filter is taken to admit it) could change: those whose pool holds
        it, and those whose filter admits it and whose pool's floor its cosine with the cached
        query reaches. Returns how many."""
        doomed = set(self._by_doc.get(doc_id, ()))
        if self._queries is not None and self._lru:
            high = self._high
            reach = self._queries[:high] @ self._unit(vector) >= self._floor[:high] - SCORE_MARGIN
            reach &= self._live[:high]
            if meta is not None:
                for (_, wkey), group in self._groups.items():
                    if wkey and not self._admits_group(group, meta):
                        reach &= self._group[:high] != group
            doomed.update(np.flatnonzero(reach).tolist())
        return self._invalidate(doomed)

    def invalidate_delete(self, doc_id: str) -> int:
        """Drops the entries whose pool holds ``doc_id``; returns how many."""
        return self._invalidate(set(self._by_doc.get(doc_id, ())))

    def clear(self) -> None:
        for slot in list(self._lru):
            self._drop(slot)

    def _admits_group(self, group: int, meta: Mapping[str, Any]) -> bool:
        slots = np.flatnonzero(self._live & (self._group == group))
        entry = self._entries[int(slots[0])] if len(slots) else None
        return entry is None or admits(entry.where, meta)

    def _invalidate(self, slots: set[int]) -> int:
        for slot in slots:
            self._drop(slot)
        self.invalidations += len(slots)
        return len(slots)

    def _drop(self, slot: int) -> None:
        entry = self._entries[slot]
        assert entry is not None
        for doc_id in entry.pool:
            held = self._by_doc[doc_id]
            held.pop(slot, None)
            if not held:
                del self._by_doc[doc_id]
        self._entries[slot] = None
        self._live[slot] = False
        self._floor[slot] = np.inf
        self._group[slot] = -1
        del self._lru[slot]
        self._free.append(slot)

    @staticmethod
    def _unit(vector: np.ndarray) -> np.ndarray:
        v = np.asarray(vector, dtype=np.float32).reshape(-1)
        norm = float(np.linalg.norm(v))
        if not math.isfinite(norm) or norm == 0.0:
            raise ValueError("vector must be finite and non-zero")
        return v / norm
