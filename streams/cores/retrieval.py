"""The retrieval core: every collection's index as state derived from the vectors topic, the
searches against it and their near-duplicate reuse. No Kafka: the retrieve stage feeds it
vector records and asks it questions; tests drive it alone.

- ``apply(partition, offset, key, record)``: one record of ``<p>.vectors`` (a ``VectorRecord``,
  a tombstone, or the indexing stage's ready marker). Indexes are per (tenant, collection,
  space): a space is one encoder identity (``model``: name/version/precision/preprocessing),
  so text and image documents of a collection, and the old and new vectors of a model
  change, are kept apart and never mixed. An upsert or delete invalidates exactly the
  cached answers it could change (``streams.policies.reuse``).
- ``search(tenant, collection, query, k, where, space)``: ANN over-fetch, exact rescoring,
  filter, top-k (``workers.retrieval.index``) in the query's space; answered from a cached
  near-duplicate's candidate pool when one is within the threshold. A tenant only ever
  reaches its own collections.
- **Model changes.** An indexing stage with a new encoder identity re-embeds every
  collection into its new space in the background and writes a ready marker per
  partition of the collection once it has caught up with it (``schemas.documents``). Until
  a space is ready, a query in it is refused (``NotReady``, retriable) while another version
  of the same model is ready for the collection, rather than answered from part of the
  collection; queries in the old space go on being answered by the old index. ``retire(now)`` drops the spaces of
  a model that are not the one in use once they have been neither searched nor changed for
  ``retire_after_s``.
- ``snapshot(directory)`` / ``restore(directory)``: every changed collection's index and
  passage texts, then a manifest naming each collection's snapshot and the topic position
  they all reflect (written last, atomically): a restart restores them and reads the topic
  from that position; anything missing or unreadable, and the topic rebuilds everything.
  ``snapshot_begin`` / ``snapshot_finish``: the same, written by a forked child from a
  copy-on-write image, so searches and updates go on while it writes.

Not thread-safe: the stage calls it from one thread (its event loop).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import shutil
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from schemas.documents import READY_PREFIX, VectorRecord, parse_vector_key
from schemas.tensor import from_wire
from streams.policies.reuse import DEFAULT_POOL_SIZE, NearDuplicateCache
from workers.retrieval.index import CollectionIndex
from workers.retrieval.results import Hit, IndexFullError

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
FORMAT = 2
"""2: collections per space (format 1, one space, is not read: the topic rebuilds)."""


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
    reuse_pool: int = DEFAULT_POOL_SIZE
    """Candidates each search keeps for the near-duplicates that reuse it (0: its hits only)."""
    retire_after_s: float = 3600.0
    """How long a space of a model that is not the one in use stays with neither a search nor
    a change before ``retire`` drops it."""


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
    searched_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Answer:
    hits: list[Hit]
    texts: list[str]
    reused: bool
    documents: int
    epoch: int
    space: str = ""
    """The encoder identity whose space answered."""


class UnknownCollection(LookupError):
    code = "not_found"


class NotReady(LookupError):
    """The query's space of the collection is still being embedded while another version of
    its model is ready (a model change in progress): retriable."""


@dataclass
class Readiness:
    """Which partitions of a collection's documents topic the indexer of one space has caught
    up with, out of how many."""

    partitions: int = 0
    seen: set[int] = field(default_factory=set)

    @property
    def ready(self) -> bool:
        return self.partitions > 0 and len(self.seen) >= self.partitions


Key = tuple[str, str, str]
"""(tenant, collection, space)."""


class RetrievalCore:
    def __init__(self, model: str, limits: CoreLimits = CoreLimits()) -> None:
        self.model = model
        """The space of a query that names none (the text encoder this stage embeds with)."""
        self.limits = limits
        self.collections: dict[Key, Collection] = {}
        self.readiness: dict[Key, Readiness] = {}
        self.retired: set[Key] = set()
        """Spaces ``retire`` dropped: their later records are skipped (a rollback to that model
        would otherwise make an index of only what came after ready)."""
        self._retired_saved: frozenset[Key] = frozenset()
        """``retired`` as the last snapshot's manifest holds it."""
        self.position: dict[int, int] = {}
        """Vectors partition -> the next offset to apply (what the indexes reflect)."""
        self.skipped = {"malformed": 0, "full": 0, "too_many_collections": 0, "retired": 0}
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
        if (tenant, name, model) in self.retired:
            self.skipped["retired"] += 1
            return
        if doc_id.startswith(READY_PREFIX):
            self._ready_marker((tenant, name, model), value)
            return
        c = self.collections.get((tenant, name, model))
        if value is None:
            # Also from the model's other versions: a document deleted during a rollout is
            # gone from the index that still answers, not only from the one being built.
            for (t, n, m), other in list(self.collections.items()):
                if (t, n) == (tenant, name) and _model_name(m) == _model_name(model) and other.index.delete(doc_id):
                    other.texts.pop(doc_id, None)
                    if other.cache is not None:
                        other.cache.invalidate_delete(doc_id)
                    self._changed(other)
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
            names = {n for t, n, _ in self.collections if t == tenant}
            if name not in names and len(names) >= self.limits.max_collections:
                self.skipped["too_many_collections"] += 1  # collections by name: its spaces count once
                return
            c = self.collections[(tenant, name, model)] = self._new(len(vector))
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

    def _ready_marker(self, key: Key, value: dict[str, Any] | None) -> None:
        got = (value or {}).get("ready")
        if not (isinstance(got, list) and len(got) == 2 and all(isinstance(x, int) and x >= 0 for x in got)
                and got[0] < got[1] <= 4096):
            self.skipped["malformed"] += 1
            return
        r = self.readiness.setdefault(key, Readiness())
        r.partitions = got[1]
        r.seen.add(got[0])

    def ready(self, tenant: str, collection: str, space: str) -> bool:
        r = self.readiness.get((tenant, collection, space))
        return r is not None and r.ready

    def _new(self, dim: int) -> Collection:
        lim = self.limits
        index = CollectionIndex(dim, overfetch=lim.overfetch, max_docs=lim.max_docs, ef=lim.ef)
        return Collection(index, cache=self._cache())

    def _cache(self) -> NearDuplicateCache | None:
        lim = self.limits
        return (NearDuplicateCache(lim.reuse_threshold, lim.reuse_entries, pool_size=lim.reuse_pool)
                if lim.reuse_entries else None)

    def _changed(self, c: Collection) -> None:
        c.epoch += 1
        c.dirty = True
        c.updated_at = time.time()

    # -- searches --------------------------------------------------------------------------

    def has(self, tenant: str, collection: str, space: str | None = None) -> bool:
        return (tenant, collection, space or self.model) in self.collections

    def search(self, tenant: str, collection: str, query: np.ndarray, k: int,
               where: dict[str, Any] | None = None, space: str | None = None) -> Answer:
        """The best ``k`` documents of the tenant's collection for ``query``, a vector in
        ``space`` (None: this core's ``model``); raises ``UnknownCollection`` when the tenant
        has no such collection (with documents) in that space, ``NotReady`` when that space is
        still being embedded while another version of its model is ready, and ``ValueError``
        for a query of the wrong dimension."""
        space = space or self.model
        c = self.collections.get((tenant, collection, space))
        if (not self.ready(tenant, collection, space) and (tenant, collection, space) not in self.retired
                and any(r.ready for (t, n, m), r in self.readiness.items()
                        if (t, n) == (tenant, collection) and m != space and _model_name(m) == _model_name(space))):
            raise NotReady(collection)  # another version of the query's model answers; this one is coming
        if c is None or len(c.index) == 0:
            raise UnknownCollection(collection)
        self.searches += 1
        c.searched_at = time.time()
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
        return Answer(hits, [c.texts.get(h.doc_id, "") for h in hits], reused, len(c.index), c.epoch, space)

    def retire(self, now: float) -> list[Key]:
        """Among a collection's spaces of one model name (its versions, precisions), once one
        is ready: keep the one in use (the most recently searched ready space; with none
        searched, the highest version) and drop every other that has been neither searched
        nor changed for ``retire_after_s`` (a replaced version, or a re-embed given up), never
        this core's own ``model`` (the space its RAG questions are embedded in). Returns what
        was dropped; their later records are skipped. A space still being built changes, and
        is kept."""
        after = self.limits.retire_after_s
        groups: dict[tuple[str, str, str], list[Key]] = {}
        for key in self.collections:
            groups.setdefault((key[0], key[1], _model_name(key[2])), []).append(key)
        dropped = []
        for keys in groups.values():
            ready = [k for k in keys if self.ready(*k)]
            if len(keys) < 2 or not ready:
                continue
            current = max(ready, key=lambda k: (self.collections[k].searched_at, _version(k[2]), k[2]))
            for key in keys:
                c = self.collections[key]
                if key not in (current, (key[0], key[1], self.model)) and now - max(c.searched_at, c.updated_at) >= after:
                    del self.collections[key]
                    self.readiness.pop(key, None)
                    self.retired.add(key)
                    dropped.append(key)
        return dropped

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
        return self.retired != self._retired_saved or any(c.dirty for c in self.collections.values())

    def snapshot(self, directory: Path) -> None:
        """Every changed collection's snapshot, then the manifest naming all of them with the
        position they reflect, written here and now (the caller keeps updates and searches
        away meanwhile). A crash at any point leaves the previous manifest valid: the
        snapshots it names are kept until a newer manifest names others."""
        plan = self._plan()
        _write_snapshot(self, plan, Path(directory))
        self._mark(plan)

    def snapshot_begin(self, directory: Path) -> "PendingSnapshot":
        """The same snapshot, written by a forked child process from a copy-on-write image of
        this one, so that neither searches nor updates wait for it (in-process, a snapshot of
        100k passages holds the GIL for about a second: docs/retrieval.md). The state is the
        one at this call; the caller polls the result (``PendingSnapshot.poll``) and hands
        it to ``snapshot_finish``. Where fork is not available it is written here, at once."""
        plan = self._plan()
        directory = Path(directory)
        if not hasattr(os, "fork"):
            _write_snapshot(self, plan, directory)
            return PendingSnapshot(plan, None, True)
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            log.warning("retrieval: cannot fork a snapshot writer; writing the snapshot in-process", exc_info=True)
            _write_snapshot(self, plan, directory)
            return PendingSnapshot(plan, None, True)
        if pid == 0:  # the child: write, and never return into the caller's code
            code = 1
            try:
                gc.disable()  # its collector would walk, and so copy, every page of the parent's objects
                _die_with(parent)
                os.nice(19)  # the searches, and the pipeline around them, come first for the CPU
                _write_snapshot(self, plan, directory)
                code = 0
            except BaseException as exc:  # noqa: BLE001 - reported through the exit status
                try:
                    os.write(2, f"retrieval snapshot writer failed: {type(exc).__name__}: {exc}\n".encode())
                except OSError:
                    pass
            finally:
                os._exit(code)
        return PendingSnapshot(plan, pid, None)

    def snapshot_finish(self, pending: "PendingSnapshot") -> bool:
        """After ``pending.poll()`` said True: the collections it wrote are marked clean (those
        not changed since ``snapshot_begin``). False changes nothing: they stay dirty and the
        previous manifest stays the one a restart reads."""
        if not pending.ok:
            return False
        self._mark(pending.plan)
        return True

    def _plan(self) -> "SnapshotPlan":
        written, named = [], []
        for (tenant, name, model), c in self.collections.items():
            if c.dirty or not c.snapshot_id:
                sid = uuid.uuid4().hex[:12]
                written.append((tenant, name, model, sid, c.epoch))
            else:
                sid = c.snapshot_id
            named.append((tenant, name, model, sid))
        ready = [[t, n, m, sorted(r.seen), r.partitions] for (t, n, m), r in self.readiness.items()]
        return SnapshotPlan(dict(self.position), written, named, ready, sorted(list(k) for k in self.retired))

    def _mark(self, plan: "SnapshotPlan") -> None:
        self._retired_saved = frozenset((t, n, m) for t, n, m in plan.retired)
        for tenant, name, model, sid, epoch in plan.written:
            c = self.collections.get((tenant, name, model))
            if c is None:  # retired since the plan
                continue
            c.snapshot_id = sid
            c.dirty = c.epoch != epoch  # changed since the snapshot's state: still to write

    def restore(self, directory: Path) -> bool:
        """The state of the last whole snapshot in ``directory`` (True), or nothing changed
        and False: the topic is then read from the start."""
        m = _read_manifest(Path(directory))
        if m is None or m.get("format") != FORMAT:
            return False
        restored: dict[Key, Collection] = {}
        for t, n, model, sid in m.get("collections", []):
            where = Path(directory) / t / n / _space_dir(model) / sid
            got = CollectionIndex.restore(where / "index")
            texts = _read_json(where / "texts.json")
            if got is None or texts is None or got[1].get("id") != sid or texts.get("id") != sid:
                log.warning("retrieval: the snapshot of %s/%s is not whole; rebuilding every index from the topic", t, n)
                return False
            restored[(t, n, model)] = Collection(got[0], dict(texts["texts"]), self._cache(), dirty=False,
                                                 snapshot_id=sid, updated_at=time.time())
        self.collections = restored
        self.readiness = {(t, n, mo): Readiness(parts, set(seen)) for t, n, mo, seen, parts in m.get("ready", [])}
        self.retired = {(t, n, mo) for t, n, mo in m.get("retired", [])}
        self._retired_saved = frozenset(self.retired)
        self.position = {int(p): int(o) for p, o in m.get("position", {}).items()}
        return True


@dataclass(frozen=True, slots=True)
class SnapshotPlan:
    """What one snapshot writes: the position it reflects, the collections written anew
    (tenant, name, space, snapshot id, epoch at the plan), every collection the manifest
    names (tenant, name, space, snapshot id) and the spaces' readiness."""

    position: dict[int, int]
    written: list[tuple[str, str, str, str, int]]
    named: list[tuple[str, str, str, str]]
    ready: list[list[Any]] = field(default_factory=list)
    retired: list[list[str]] = field(default_factory=list)


@dataclass
class PendingSnapshot:
    """A snapshot being written by a child process (``pid``), or already written (``ok``)."""

    plan: SnapshotPlan
    pid: int | None
    ok: bool | None

    def poll(self) -> bool | None:
        """None while the writer runs; then whether it wrote the whole snapshot."""
        if self.ok is None and self.pid is not None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its result is unknown
                self.ok = False
                return False
            if pid:
                self.ok = os.waitstatus_to_exitcode(status) == 0
        return self.ok


def _write_snapshot(core: RetrievalCore, plan: SnapshotPlan, directory: Path) -> None:
    """The collections of ``plan.written``, then the manifest (atomically), then every
    snapshot folder of a named collection that the manifest does not name."""
    directory.mkdir(parents=True, exist_ok=True)
    for tenant, name, model, sid, _ in plan.written:
        c = core.collections[(tenant, name, model)]
        where = directory / tenant / name / _space_dir(model) / sid
        c.index.snapshot(where / "index", {"id": sid})
        _write_json(where / "texts.json", {"id": sid, "texts": c.texts})
    manifest = {"format": FORMAT, "position": {str(p): o for p, o in plan.position.items()},
                "collections": [list(n) for n in plan.named], "ready": plan.ready, "retired": plan.retired}
    _write_json(directory / MANIFEST, manifest)
    named = {(t, n, _space_dir(m)): sid for t, n, m, sid in plan.named}
    for t, n in {(t, n) for t, n, _, _ in plan.named}:
        for space in (directory / t / n).iterdir():  # retired spaces, older snapshots, format 1's folders go
            if not (space.is_dir() and _is_space_dir(space.name)):
                if space.is_dir():
                    shutil.rmtree(space, ignore_errors=True)
                else:
                    space.unlink(missing_ok=True)
                continue
            for old in space.iterdir():
                if named.get((t, n, space.name)) != old.name:
                    shutil.rmtree(old, ignore_errors=True)


def _space_dir(model: str) -> str:
    """A space's folder name: an identity holds slashes."""
    return "s" + hashlib.sha256(model.encode()).hexdigest()[:16]


def _is_space_dir(name: str) -> bool:
    return len(name) == 17 and name[0] == "s" and all(ch in "0123456789abcdef" for ch in name[1:])


def _model_name(identity: str) -> str:
    return identity.split("/", 1)[0]


def _version(identity: str) -> int:
    parts = identity.split("/")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1


def _die_with(parent: int) -> None:
    """Linux: this process is killed when ``parent`` dies (a kill -9 of the stage takes its
    snapshot writer with it); no signal handler of the parent's stays installed."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


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
