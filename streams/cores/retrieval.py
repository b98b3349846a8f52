"""The retrieval core: every collection's index as state derived from the vectors topic, the
searches against it and their near-duplicate reuse. No Kafka: the retrieve stage feeds it
vector records and asks it questions; tests drive it alone.

- ``apply(partition, offset, key, record)``: one record of ``<p>.vectors`` (a ``VectorRecord``
  or a tombstone). Indexes are per (tenant, collection), in the space of one encoder
  identity (``model``): records of another model are counted and skipped, so a model
  change never mixes spaces. An upsert or delete invalidates exactly the cached answers it
  could change (``streams.policies.reuse``).
- ``search(tenant, collection, query, k, where)``: ANN over-fetch, exact rescoring, filter,
  top-k (``workers.retrieval.index``); answered from a cached near-duplicate's candidate
  pool when one is within the threshold. A tenant only ever reaches its own collections.
- ``snapshot(directory)`` / ``restore(directory)``: every changed collection's index and
  passage texts, then a manifest naming each collection's snapshot and the topic position
  they all reflect (written last, atomically): a restart restores them and reads the topic
  from that position; anything missing or unreadable, and the topic rebuilds everything.

Not thread-safe: the stage calls it from one thread (its event loop).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from schemas.documents import VectorRecord, parse_vector_key
from schemas.tensor import from_wire
from streams.policies.reuse import NearDuplicateCache
from workers.retrieval.index import CollectionIndex, Hit, IndexFullError

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
FORMAT = 1


@dataclass(frozen=True, slots=True)
class CoreLimits:
    max_docs: int = 200_000
    max_collections: int = 64
    """Per tenant."""
    overfetch: int = 4
    ef: int = 128
    reuse_threshold: float = 0.80
    reuse_entries: int = 1024
    """Per collection; 0 turns reuse off."""


@dataclass
class Collection:
    index: CollectionIndex
    texts: dict[str, str] = field(default_factory=dict)
    cache: NearDuplicateCache | None = None
    epoch: int = 0
    """Bumps with every change: answers name the index version they came from."""
    dirty: bool = True
    snapshot_id: str = ""
    updated_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Answer:
    hits: list[Hit]
    texts: list[str]
    reused: bool
    documents: int
    epoch: int


class UnknownCollection(LookupError):
    code = "not_found"


class RetrievalCore:
    def __init__(self, model: str, limits: CoreLimits = CoreLimits()) -> None:
        self.model = model
        self.limits = limits
        self.collections: dict[tuple[str, str], Collection] = {}
        self.position: dict[int, int] = {}
        """Vectors partition -> the next offset to apply (what the indexes reflect)."""
        self.skipped = {"other_model": 0, "malformed": 0, "full": 0, "too_many_collections": 0}
        self.searches = 0

    # -- the vectors topic ---------------------------------------------------------------------

    def apply(self, partition: int, offset: int, key: bytes | None, value: dict[str, Any] | None) -> None:
        """One record of the vectors topic (``value``: its decoded map, None for a tombstone)."""
        self.position[partition] = max(self.position.get(partition, 0), offset + 1)
        where = parse_vector_key(key)
        if where is None:
            self.skipped["malformed"] += 1
            return
        tenant, name, model, doc_id = where
        if model != self.model:
            self.skipped["other_model"] += 1
            return
        c = self.collections.get((tenant, name))
        if value is None:
            if c is not None and c.index.delete(doc_id):
                c.texts.pop(doc_id, None)
                if c.cache is not None:
                    c.cache.invalidate_delete(doc_id)
                self._changed(c)
            return
        try:
            rec = VectorRecord.from_wire(value)
            vector = np.asarray(from_wire(rec.vector), dtype=np.float32).reshape(-1)
        except (ValueError, TypeError):
            self.skipped["malformed"] += 1
            return
        if (rec.tenant, rec.collection, rec.doc) != (tenant, name, doc_id):
            self.skipped["malformed"] += 1  # a value that disagrees with its key is not ours
            return
        if c is None:
            if sum(1 for t, _ in self.collections if t == tenant) >= self.limits.max_collections:
                self.skipped["too_many_collections"] += 1
                return
            c = self.collections[(tenant, name)] = self._new(len(vector))
        try:
            c.index.upsert(doc_id, vector, rec.meta)
        except IndexFullError:
            self.skipped["full"] += 1
            return
        except ValueError:  # a vector of another dimension or zero
            self.skipped["malformed"] += 1
            return
        c.texts[doc_id] = rec.text
        if c.cache is not None:
            c.cache.invalidate_upsert(doc_id, vector, rec.meta)
        self._changed(c)

    def _new(self, dim: int) -> Collection:
        lim = self.limits
        index = CollectionIndex(dim, overfetch=lim.overfetch, max_docs=lim.max_docs, ef=lim.ef)
        return Collection(index, cache=self._cache())

    def _cache(self) -> NearDuplicateCache | None:
        lim = self.limits
        return NearDuplicateCache(lim.reuse_threshold, lim.reuse_entries) if lim.reuse_entries else None

    def _changed(self, c: Collection) -> None:
        c.epoch += 1
        c.dirty = True
        c.updated_at = time.time()

    # -- searches --------------------------------------------------------------------------

    def has(self, tenant: str, collection: str) -> bool:
        return (tenant, collection) in self.collections

    def search(self, tenant: str, collection: str, query: np.ndarray, k: int,
               where: dict[str, Any] | None = None) -> Answer:
        """The best ``k`` documents of the tenant's collection for ``query``; raises
        ``UnknownCollection`` when the tenant has no such collection (with documents), and
        ``ValueError`` for a query of the wrong dimension."""
        c = self.collections.get((tenant, collection))
        if c is None or len(c.index) == 0:
            raise UnknownCollection(collection)
        self.searches += 1
        q = np.asarray(query, dtype=np.float32).reshape(-1)
        hits = None
        if c.cache is not None:
            found = c.cache.lookup(q, k, where, rescore=lambda ids, qv, kk: c.index.rescore(ids, qv, kk, where=where))
            hits = list(found) if found is not None else None
        reused = hits is not None
        if hits is None:
            pool_size = c.cache.pool_size if c.cache is not None else 0
            hits, pool = c.index.search_with_pool(q, k, where=where, pool_size=pool_size)
            if c.cache is not None:
                c.cache.store(q, k, where, hits, pool)
        return Answer(hits, [c.texts.get(h.doc_id, "") for h in hits], reused, len(c.index), c.epoch)

    def stats(self) -> dict[str, Any]:
        return {
            "collections": len(self.collections),
            "documents": sum(len(c.index) for c in self.collections.values()),
            "memory_bytes": sum(c.index.memory_bytes() for c in self.collections.values()),
            "reuse_hits": sum(c.cache.hits for c in self.collections.values() if c.cache),
            "reuse_misses": sum(c.cache.misses for c in self.collections.values() if c.cache),
        }

    # -- snapshots -------------------------------------------------------------------------

    @property
    def dirty(self) -> bool:
        return any(c.dirty for c in self.collections.values())

    def snapshot(self, directory: Path) -> None:
        """Every changed collection's snapshot, then the manifest naming all of them with the
        position they reflect. A crash at any point leaves the previous manifest valid: the
        snapshots it names are kept until a newer manifest names others."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        old = _read_manifest(directory)
        for (tenant, name), c in self.collections.items():
            if not c.dirty and c.snapshot_id:
                continue
            sid = uuid.uuid4().hex[:12]
            where = directory / tenant / name / sid
            c.index.snapshot(where / "index", {"id": sid})
            _write_json(where / "texts.json", {"id": sid, "texts": c.texts})
            c.snapshot_id, c.dirty = sid, False
        manifest = {"format": FORMAT, "model": self.model, "position": {str(p): o for p, o in self.position.items()},
                    "collections": [[t, n, c.snapshot_id] for (t, n), c in self.collections.items()]}
        _write_json(directory / MANIFEST, manifest)
        keep = {(t, n, c.snapshot_id) for (t, n), c in self.collections.items()}
        for t, n, sid in (old or {}).get("collections", []):
            if (t, n, sid) not in keep:
                shutil.rmtree(directory / t / n / sid, ignore_errors=True)

    def restore(self, directory: Path) -> bool:
        """The state of the last whole snapshot in ``directory`` (True), or nothing changed
        and False: the topic is then read from the start."""
        m = _read_manifest(Path(directory))
        if m is None or m.get("format") != FORMAT or m.get("model") != self.model:
            return False
        restored: dict[tuple[str, str], Collection] = {}
        for t, n, sid in m.get("collections", []):
            where = Path(directory) / t / n / sid
            got = CollectionIndex.restore(where / "index")
            texts = _read_json(where / "texts.json")
            if got is None or texts is None or got[1].get("id") != sid or texts.get("id") != sid:
                log.warning("retrieval: the snapshot of %s/%s is not whole; rebuilding every index from the topic", t, n)
                return False
            restored[(t, n)] = Collection(got[0], dict(texts["texts"]), self._cache(), dirty=False, snapshot_id=sid)
        self.collections = restored
        self.position = {int(p): int(o) for p, o in m.get("position", {}).items()}
        return True


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _read_manifest(directory: Path) -> dict[str, Any] | None:
    m = _read_json(directory / MANIFEST)
    return m if isinstance(m, dict) else None
