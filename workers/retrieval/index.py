"""The ANN index of one collection: approximate first pass, exact answer.

``CollectionIndex`` holds, per document, its unit float32 vector and its metadata, and an
hnswlib HNSW graph over the same vectors (inner product). A search asks the graph for
``k * overfetch`` candidates, rescores them exactly (cosine = dot of unit vectors, against
the stored floats), and returns the best ``k``, ties broken by doc id. A filter is given to
the graph walk (it skips what the filter refuses, so the fetch is of admitted documents);
a filter that admits few documents is answered exactly over them instead (the graph would
have to be walked far to find them). A deleted document is marked deleted in the graph
(skipped by every walk) and its slot, graph label included, is reused by the next new one;
an upsert of a present document moves its graph node in place.

The index is state derived from a collection topic (DESIGN.md, Retrieval): ``snapshot``
writes it with the topic position it reflects, ``restore`` reads it back or returns None
(absent, corrupt, another format or library version), and the caller rebuilds from the
topic. docs/retrieval.md says why hnswlib and what was measured.

Not thread-safe: one thread mutates and searches (or the caller holds a lock around every
call). Searches never return a deleted id: every candidate is checked against the live
documents before it is scored.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterable

import hnswlib
import numpy as np

from workers.retrieval.postings import Postings, admits
from workers.retrieval.results import Candidate, Hit, IndexFullError, unit

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 1
"""Bumped whenever the files a snapshot holds change meaning; an older one is not read."""
DEFAULT_MAX_DOCS = 1_000_000
LIBRARY_VERSION = importlib.metadata.version("hnswlib")
DEFAULT_LIBRARY_PARAMS: dict[str, Any] = {
    "M": 32,                 # graph degree (16 measured recall@10 0.944 on real passages)
    "ef_construction": 128,  # candidates kept while linking a new node
    "ef": 128,               # candidates kept while searching; at least the fetch
    "threads": 1,            # graph threads for a batch upsert (0: all cores); searches use one
    "random_seed": 100,      # node levels
}
EXACT_FILTER_MAX = 4096
"""A filter admitting at most this many documents is answered by exact search over them
(about 1.5 MB of vectors at 384-d: well under a millisecond), not through the graph."""
_CURRENT = "CURRENT"


class CollectionIndex:
    """One collection's documents (``doc_id -> unit vector, meta``) and its ANN graph.

    ``overfetch``: the graph is asked for ``k * overfetch`` candidates per search (more
    when a filter refuses some). ``max_docs``: the most documents held; an upsert past it
    raises ``IndexFullError``. ``library_params``: graph settings over
    ``DEFAULT_LIBRARY_PARAMS`` (hnswlib's ``M``, ``ef_construction``, ``ef``,
    ``random_seed``; ``threads``). ``version`` bumps once per mutating call.
    """

    def __init__(self, dim: int, *, overfetch: int = 4, max_docs: int = DEFAULT_MAX_DOCS,
                 **library_params: Any) -> None:
        if dim < 1 or overfetch < 1 or max_docs < 1:
            raise ValueError(f"dim, overfetch and max_docs must be positive, got {dim}, {overfetch}, {max_docs}")
        unknown = set(library_params) - set(DEFAULT_LIBRARY_PARAMS)
        if unknown:
            raise ValueError(f"unknown library parameters {sorted(unknown)}; known: {sorted(DEFAULT_LIBRARY_PARAMS)}")
        self.dim = dim
        self.overfetch = overfetch
        self.max_docs = max_docs
        self.library_params = {**DEFAULT_LIBRARY_PARAMS, **library_params}
        self.version = 0
        self._vectors = np.zeros((min(1024, max_docs), dim), dtype=np.float32)
        self._ann = self._new_graph(len(self._vectors))
        self._ids: list[str | None] = []      # per slot; None: a free slot
        self._metas: list[dict | None] = []
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self._postings = Postings()  # the metadata filters' posting lists

    # -- mutation -------------------------------------------------------------------------

    def upsert(self, doc_id: str, vector: np.ndarray, meta: dict | None = None) -> None:
        """Adds ``doc_id`` or replaces its vector and meta. ``meta`` must be a JSON-able dict
        with str keys. Raises ValueError/TypeError for bad input, ``IndexFullError`` past
        ``max_docs``; on a raise nothing changed."""
        self.upsert_many([(doc_id, vector, meta)])

    def upsert_many(self, items: list[tuple[str, np.ndarray, dict | None]]) -> None:
        """``upsert`` of each item, the last of a repeated id winning; all are checked before
        any is applied (a bad item changes nothing), and the graph takes them as one batch."""
        latest: dict[str, tuple[np.ndarray, dict]] = {}
        for doc_id, vector, meta in items:
            if not isinstance(doc_id, str) or not doc_id:
                raise TypeError(f"doc_id must be a non-empty str, got {doc_id!r}")
            latest[doc_id] = (unit(vector, self.dim, f"vector of {doc_id!r}"), self._checked_meta(doc_id, meta))
        if not latest:
            return
        new = sum(1 for d in latest if d not in self._slot)
        if len(self) + new > self.max_docs:
            raise IndexFullError(f"the collection holds {len(self)} documents; {new} more would pass "
                                 f"max_docs={self.max_docs}")
        slots = []
        for doc_id, (vector, meta) in latest.items():
            slot = self._slot.get(doc_id)
            if slot is None:
                slot = self._take_slot(doc_id)
            else:
                self._unpost(slot)
            self._vectors[slot] = vector
            self._metas[slot] = meta
            self._post(slot)
            slots.append(slot)
        if self._ann.get_max_elements() < len(self._vectors):
            self._ann.resize_index(len(self._vectors))
        keys = np.array(slots, dtype=np.int64)
        threads = int(self.library_params["threads"]) or -1
        # A present label (an update, or a freed slot's) is unmarked and moved in place.
        self._ann.add_items(self._vectors[keys], keys, num_threads=threads if len(keys) > 1 else 1)
        self.version += 1

    def delete(self, doc_id: str) -> bool:
        """Removes ``doc_id``; False (and no version bump) when it was not there."""
        slot = self._slot.pop(doc_id, None)
        if slot is None:
            return False
        self._unpost(slot)
        self._ann.mark_deleted(slot)
        self._ids[slot] = None
        self._metas[slot] = None
        self._free.append(slot)
        self.version += 1
        return True

    # -- reading --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, doc_id: object) -> bool:
        return doc_id in self._slot

    def vector(self, doc_id: str) -> np.ndarray | None:
        """A copy of the stored unit vector of ``doc_id``, or None."""
        slot = self._slot.get(doc_id)
        return None if slot is None else self._vectors[slot].copy()

    def meta(self, doc_id: str) -> dict | None:
        slot = self._slot.get(doc_id)
        return None if slot is None else dict(self._metas[slot] or {})

    def memory_bytes(self) -> int:
        """Bytes held by the stored vectors and the graph (its serialized size; metadata not
        counted)."""
        return int(self._vectors.nbytes + self._ann.index_file_size())

    def search(self, query: np.ndarray, k: int, *, where: dict | None = None) -> list[Hit]:
        """The ``k`` live documents closest to ``query`` (cosine) that ``where`` admits, best
        first, ties by doc id; fewer when fewer are admitted. ``where`` maps meta keys to a
        value (equality) or a list/tuple/set of values (any of them); scalar meta values
        only. Raises ValueError for a query of the wrong shape or a zero query."""
        return self.search_with_pool(query, k, where=where)[0]

    def search_with_pool(self, query: np.ndarray, k: int, *, where: dict | None = None,
                         pool_size: int = 0) -> tuple[list[Hit], list[Candidate]]:
        """``search``'s hits and the candidate pool they were chosen from: the best
        ``max(k, pool_size)`` candidates, rescored exactly, best first (the hits are its first
        ``k``); fewer when fewer are admitted. A ``pool_size`` above ``k * overfetch`` widens
        the graph's fetch (and its ef) to it, so the pool costs a wider walk, not a second one.
        A near-duplicate query can then be answered by ``rescore`` over the pool
        (``streams.policies.reuse``)."""
        q = unit(query, self.dim, "query")
        if k <= 0 or not self._slot:
            return [], []
        n = max(k, pool_size)
        admitted = self._postings.admitted(where) if where else None
        if admitted is not None and len(admitted) <= max(EXACT_FILTER_MAX, k * self.overfetch, n):
            return self._answer(q, k, self._top(q, n, np.fromiter(admitted, dtype=np.int64, count=len(admitted))))
        fetch = min(max(k * self.overfetch, n), len(self._slot) if admitted is None else len(admitted))
        self._ann.set_ef(max(int(self.library_params["ef"]), fetch))
        try:
            labels, _ = self._ann.knn_query(q, fetch, num_threads=1,
                                            filter=None if admitted is None else admitted.__contains__)
        except RuntimeError:  # the walk found fewer than ``fetch`` (deletions cut the graph up): be exact
            return self._answer(q, k, self._top(q, n, self._live_slots(where)))
        keys = labels[0].astype(np.int64)
        keys = keys[[self._ids[s] is not None for s in keys]]  # never a deleted id, whatever the graph says
        return self._answer(q, k, self._ranked(q, n, keys))

    def rescore(self, doc_ids: Iterable[str], query: np.ndarray, k: int, *, where: dict | None = None) -> list[Hit]:
        """The best ``k`` of ``doc_ids`` for ``query``, scored exactly against the stored
        vectors, as ``search`` ranks them (best first, ties by doc id): ids no longer present
        and documents ``where`` does not admit are skipped, a repeated id counts once. No
        graph walk: a dot product per id (microseconds for a few hundred). Raises ValueError
        for a query of the wrong shape or a zero query."""
        q = unit(query, self.dim, "query")
        found = dict.fromkeys(s for s in map(self._slot.get, doc_ids) if s is not None)
        slots = [s for s in found if admits(where, self._metas[s])] if where else list(found)
        if k <= 0 or not slots:
            return []
        return self._answer(q, k, self._ranked(q, k, np.array(slots, dtype=np.int64)))[0]

    def exact_search(self, query: np.ndarray, k: int, *, where: dict | None = None) -> list[Hit]:
        """What ``search`` approximates: every admitted document scored (for measuring)."""
        q = unit(query, self.dim, "query")
        slots = self._live_slots(where)
        return self._answer(q, k, self._top(q, k, slots))[0] if k > 0 and len(slots) else []

    # -- snapshots ------------------------------------------------------------------------

    def snapshot(self, directory: Path, position: dict[str, Any]) -> None:
        """Writes the index and ``position`` (JSON-able, opaque here: the topic offsets it
        reflects) under ``directory``: into a fresh folder first, then ``CURRENT`` names it
        by an atomic rename, then older snapshots go. A crash at any point leaves the
        previous snapshot or this one, whole."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        name = f"snap-{self.version}-{uuid.uuid4().hex[:8]}"
        tmp = directory / f".tmp-{name}"
        tmp.mkdir()
        try:
            high = len(self._ids)
            np.save(tmp / "vectors.npy", self._vectors[:high])
            (tmp / "docs.json").write_text(json.dumps(
                [None if d is None else [d, self._metas[s]] for s, d in enumerate(self._ids)]))
            self._ann.save_index(str(tmp / "graph.hnsw"))
            files = {f: _digest(tmp / f) for f in ("vectors.npy", "docs.json", "graph.hnsw")}
            manifest = {"format": SNAPSHOT_FORMAT, "library": "hnswlib", "library_version": LIBRARY_VERSION,
                        "dim": self.dim, "overfetch": self.overfetch, "max_docs": self.max_docs,
                        "library_params": self.library_params, "version": self.version, "count": len(self),
                        "position": position, "files": files}
            (tmp / "manifest.json").write_text(json.dumps(manifest))
            for f in tmp.iterdir():
                _fsync(f)
            os.rename(tmp, directory / name)
            current_tmp = directory / f".{_CURRENT}.{name}"
            current_tmp.write_text(name + "\n")
            _fsync(current_tmp)
            os.replace(current_tmp, directory / _CURRENT)
            _fsync(directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in directory.iterdir():
            if old.name != name and (old.name.startswith("snap-") or old.name.startswith(".tmp-")):
                shutil.rmtree(old, ignore_errors=True)

    @classmethod
    def restore(cls, directory: Path) -> tuple["CollectionIndex", dict] | None:
        """(the index, the position it was snapshot with), or None when ``directory`` holds
        no whole snapshot this code can read (absent, truncated, altered, another format
        or hnswlib version). Never raises for what it finds on disk."""
        try:
            return cls._restore(Path(directory))
        except FileNotFoundError:
            return None
        except Exception as exc:
            log.warning("snapshot in %s not restored (%s: %s); the topic rebuilds it", directory,
                        type(exc).__name__, exc)
            return None

    @classmethod
    def _restore(cls, directory: Path) -> tuple["CollectionIndex", dict] | None:
        snap = directory / (directory / _CURRENT).read_text().strip()
        manifest = json.loads((snap / "manifest.json").read_text())
        if manifest.get("format") != SNAPSHOT_FORMAT or manifest.get("library_version") != LIBRARY_VERSION:
            log.info("snapshot in %s is format %s of hnswlib %s: not this one", directory,
                     manifest.get("format"), manifest.get("library_version"))
            return None
        for f, digest in manifest["files"].items():
            if _digest(snap / f) != digest:
                raise ValueError(f"{f} does not match its digest")
        index = cls(manifest["dim"], overfetch=manifest["overfetch"], max_docs=manifest["max_docs"],
                    **manifest["library_params"])
        vectors = np.load(snap / "vectors.npy", allow_pickle=False)
        docs = json.loads((snap / "docs.json").read_text())
        if vectors.dtype != np.float32 or vectors.shape != (len(docs), index.dim):
            raise ValueError(f"vectors of shape {vectors.shape} for {len(docs)} slots")
        index._vectors = np.zeros((max(len(docs), 1), index.dim), dtype=np.float32)
        index._vectors[:len(docs)] = vectors
        for slot, doc in enumerate(docs):
            index._ids.append(None if doc is None else str(doc[0]))
            index._metas.append(None if doc is None else doc[1])
            if doc is None:
                index._free.append(slot)
            else:
                index._slot[str(doc[0])] = slot
                index._post(slot)
        graph = hnswlib.Index(space="ip", dim=index.dim)
        graph.load_index(str(snap / "graph.hnsw"), max_elements=len(index._vectors))
        graph.set_num_threads(1)
        if graph.element_count != len(docs) or len(index._slot) != manifest["count"]:
            raise ValueError(f"graph holds {graph.element_count} labels for {len(docs)} slots")
        index._ann = graph
        index.version = int(manifest["version"])
        return index, manifest["position"]

    # -- internals ------------------------------------------------------------------------

    def _new_graph(self, capacity: int) -> hnswlib.Index:
        p = self.library_params
        graph = hnswlib.Index(space="ip", dim=self.dim)
        graph.init_index(max_elements=capacity, M=int(p["M"]), ef_construction=int(p["ef_construction"]),
                         random_seed=int(p["random_seed"]))
        graph.set_ef(int(p["ef"]))
        graph.set_num_threads(1)
        return graph

    def _checked_meta(self, doc_id: str, meta: dict | None) -> dict:
        meta = {} if meta is None else meta
        if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
            raise TypeError(f"meta of {doc_id!r} must be a dict with str keys")
        try:
            json.dumps(meta)  # a snapshot must be able to write it
        except (TypeError, ValueError) as exc:
            raise TypeError(f"meta of {doc_id!r} is not JSON-able: {exc}") from None
        return dict(meta)

    def _take_slot(self, doc_id: str) -> int:
        if self._free:
            slot = self._free.pop()
            self._ids[slot] = doc_id
        else:
            slot = len(self._ids)
            if slot >= len(self._vectors):
                grown = np.zeros((min(2 * len(self._vectors), self.max_docs), self.dim), dtype=np.float32)
                grown[:slot] = self._vectors[:slot]
                self._vectors = grown
            self._ids.append(doc_id)
            self._metas.append(None)
        self._slot[doc_id] = slot
        return slot

    def _post(self, slot: int) -> None:
        self._postings.add(slot, self._metas[slot])

    def _unpost(self, slot: int) -> None:
        self._postings.remove(slot, self._metas[slot])

    def _live_slots(self, where: dict | None) -> np.ndarray:
        if where:
            admitted = self._postings.admitted(where)
            return np.fromiter(admitted, dtype=np.int64, count=len(admitted))
        return np.array([s for s, d in enumerate(self._ids) if d is not None], dtype=np.int64)

    def _scores(self, q: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Cosines of ``q`` with ``slots``, summed in float64 and rounded to float32: the same
        vector scores the same wherever its row sits (a float32 BLAS sum need not)."""
        return (self._vectors[slots].astype(np.float64) @ q.astype(np.float64)).astype(np.float32)

    def _top(self, q: np.ndarray, n: int, slots: np.ndarray) -> list[tuple[float, int]]:
        """The best ``n`` of ``slots`` as (score, slot), ranked by ``_ranked``; a first float32
        pass keeps only the contenders (ties and near ties at the n-th included)."""
        if len(slots) > 4 * n:
            scores = self._vectors[slots] @ q
            nth = np.partition(scores, len(scores) - n)[len(scores) - n]
            slots = slots[scores >= nth - 1e-5]
        return self._ranked(q, n, slots)

    def _ranked(self, q: np.ndarray, n: int, slots: np.ndarray) -> list[tuple[float, int]]:
        """(score, slot) of the best ``n`` of ``slots``, score descending, ties by doc id."""
        scores = self._scores(q, slots)
        order = np.argsort(-scores, kind="stable")
        ranked = scores[order]
        if np.any(ranked[1:] == ranked[:-1]):  # a tie somewhere: ordered by doc id (rare, slower)
            return sorted(zip(scores.tolist(), slots.tolist()), key=lambda t: (-t[0], self._ids[t[1]]))[:n]
        return list(zip(ranked[:n].tolist(), slots[order[:n]].tolist()))

    def _answer(self, q: np.ndarray, k: int, ranked: list[tuple[float, int]]) -> tuple[list[Hit], list[Candidate]]:
        hits = [Hit(self._ids[s], score, dict(self._metas[s] or {})) for score, s in ranked[:k]]  # type: ignore[arg-type]
        return hits, [Candidate(self._ids[s], score) for score, s in ranked]  # type: ignore[arg-type]


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
