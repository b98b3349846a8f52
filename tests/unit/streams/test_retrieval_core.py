"""The retrieval core without a broker: vector records in, searches out, snapshots."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.documents import VectorRecord, vector_key
from schemas.tensor import to_wire
from streams.cores.retrieval import CoreLimits, NotReady, RetrievalCore, UnknownCollection, _space_dir

MODEL = "m/1/int8/p1"
DIM = 16


def vec(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


class Feed:
    """Writes vector records into a core as the vectors topic would, one partition."""

    def __init__(self, core: RetrievalCore) -> None:
        self.core, self.offset = core, 0

    def put(self, doc: str, v: np.ndarray, tenant: str = "acme", coll: str = "kb", model: str = MODEL,
            meta: dict | None = None, text: str | None = None) -> None:
        rec = VectorRecord(tenant=tenant, collection=coll, doc=doc, model=model, vector=to_wire(v, "float16"),
                           text=text if text is not None else f"text of {doc}", meta=meta or {})
        self.raw(vector_key(tenant, coll, model, doc), rec.to_wire())

    def delete(self, doc: str, tenant: str = "acme", coll: str = "kb") -> None:
        self.raw(vector_key(tenant, coll, MODEL, doc), None)

    def raw(self, key: bytes | None, value: dict | None) -> None:
        self.core.apply(0, self.offset, key, value)
        self.offset += 1


@pytest.fixture
def core() -> RetrievalCore:
    return RetrievalCore(MODEL, CoreLimits(max_docs=100, max_collections=2, reuse_threshold=0.999))


def test_a_search_finds_the_nearest_documents_with_their_texts_and_follows_updates_and_deletes(core):
    feed = Feed(core)
    for i in range(20):
        feed.put(f"d{i}", vec(i), meta={"even": i % 2 == 0})
    a = core.search("acme", "kb", vec(3), 3)
    assert a.hits[0].doc_id == "d3" and a.texts[0] == "text of d3" and a.documents == 20 and not a.reused
    assert all(h.meta["even"] for h in core.search("acme", "kb", vec(3), 5, {"even": True}).hits)
    feed.delete("d3")
    assert "d3" not in [h.doc_id for h in core.search("acme", "kb", vec(3), 5).hits]
    feed.put("d4", vec(3), text="moved")
    b = core.search("acme", "kb", vec(3), 1)
    assert b.hits[0].doc_id == "d4" and b.texts == ["moved"]
    assert core.position == {0: feed.offset}


def test_a_repeated_query_is_answered_from_the_reuse_cache_until_an_upsert_could_change_it(core):
    feed = Feed(core)
    for i in range(10):
        feed.put(f"d{i}", vec(i))
    first = core.search("acme", "kb", vec(5), 3)
    again = core.search("acme", "kb", vec(5), 3)
    assert again.reused and [h.doc_id for h in again.hits] == [h.doc_id for h in first.hits]
    feed.put("new", vec(5))  # nearer than anything cached: the cached answer must go
    after = core.search("acme", "kb", vec(5), 3)
    assert not after.reused and [h.doc_id for h in after.hits][:2] == ["d5", "new"]  # a tie: by id


def test_a_tenant_never_reaches_another_tenants_collection(core):
    feed = Feed(core)
    feed.put("secret", vec(1), tenant="other")
    with pytest.raises(UnknownCollection):
        core.search("acme", "kb", vec(1), 3)
    feed.put("mine", vec(2))
    assert [h.doc_id for h in core.search("acme", "kb", vec(1), 5).hits] == ["mine"]


def test_records_of_another_model_go_to_their_own_space_and_malformed_ones_and_past_the_bounds_are_skipped(core):
    feed = Feed(core)
    feed.put("d", vec(1), tenant="t2", model="m/2/int8/p1")
    assert core.has("t2", "kb", "m/2/int8/p1") and not core.has("t2", "kb")
    with pytest.raises(UnknownCollection):  # a query of the default space never sees another's vectors
        core.search("t2", "kb", vec(1), 1)
    assert core.search("t2", "kb", vec(1), 1, space="m/2/int8/p1").hits[0].doc_id == "d"
    feed.raw(b"not a key", {"x": 1})
    feed.raw(vector_key("acme", "kb", MODEL, "d"), {"v": 1, "type": "vector"})
    rec = VectorRecord(tenant="forged", collection="kb", doc="d", model=MODEL, vector=to_wire(vec(1)), text="")
    feed.raw(vector_key("acme", "kb", MODEL, "d"), rec.to_wire())  # value and key disagree
    feed.raw(vector_key("acme", "kb", MODEL, "\x00ready:0"), {"ready": [3, 2]})  # a marker past its partitions
    assert core.skipped["malformed"] == 4 and not core.has("acme", "kb")
    feed.put("a", vec(1), coll="c1")
    feed.put("b", vec(1), coll="c2")
    feed.put("c", vec(1), coll="c3")  # a third collection of the tenant: over max_collections
    assert core.skipped["too_many_collections"] == 1 and not core.has("acme", "c3")
    small = RetrievalCore(MODEL, CoreLimits(max_docs=2))
    f2 = Feed(small)
    for i in range(3):
        f2.put(f"d{i}", vec(i))
    assert small.skipped["full"] == 1 and small.stats()["documents"] == 2


def test_a_snapshot_restores_every_collection_and_the_position(core, tmp_path):
    feed = Feed(core)
    for i in range(12):
        feed.put(f"d{i}", vec(i), coll="kb" if i % 2 else "other")
    core.snapshot(tmp_path)
    feed.put("late", vec(99))  # after the snapshot: replayed from the topic
    back = RetrievalCore(MODEL)
    assert back.restore(tmp_path)
    assert back.position == {0: 12} and set(back.collections) == {("acme", "kb", MODEL), ("acme", "other", MODEL)}
    a = back.search("acme", "kb", vec(3), 1)
    assert a.hits[0].doc_id == "d3" and a.texts == ["text of d3"]
    # A second snapshot rewrites only what changed and drops what no manifest names.
    core.snapshot(tmp_path)
    assert len(list((tmp_path / "acme" / "kb").rglob("texts.json"))) == 1


def test_a_damaged_or_foreign_snapshot_is_not_restored(core, tmp_path):
    feed = Feed(core)
    feed.put("d", vec(1))
    core.snapshot(tmp_path)
    manifest = tmp_path / "manifest.json"
    good = manifest.read_text()
    manifest.write_text(good.replace('"format": 2', '"format": 1'))  # one space per snapshot: not ours
    assert not RetrievalCore(MODEL).restore(tmp_path)
    manifest.write_text(good)
    for f in (tmp_path / "acme" / "kb").rglob("texts.json"):
        f.write_text("{")
    fresh = RetrievalCore(MODEL)
    assert not fresh.restore(tmp_path) and not fresh.collections and fresh.position == {}
    assert not RetrievalCore(MODEL).restore(tmp_path / "absent")


def _finished(pending, timeout_s: float = 30.0):
    import time
    deadline = time.monotonic() + timeout_s
    while (ok := pending.poll()) is None:
        assert time.monotonic() < deadline, "the snapshot writer did not finish"
        time.sleep(0.01)
    return ok


def test_a_forked_snapshot_holds_the_state_of_its_start_while_searches_and_updates_go_on(core, tmp_path):
    feed = Feed(core)
    for i in range(12):
        feed.put(f"d{i}", vec(i))
    pending = core.snapshot_begin(tmp_path)
    assert pending.pid not in (None, 0)  # written by a child process
    feed.put("late", vec(99), text="after the fork")  # the parent goes on while the child writes
    feed.delete("d3")
    assert core.search("acme", "kb", vec(99), 1).hits[0].doc_id == "late"
    assert _finished(pending) and core.snapshot_finish(pending)
    assert core.dirty  # changed since the snapshot's start: written by the next one
    back = RetrievalCore(MODEL)
    assert back.restore(tmp_path)
    assert back.position == {0: 12}  # the position of the fork's state: the topic replays the rest
    assert "late" not in back.collections[("acme", "kb", MODEL)].texts
    assert back.search("acme", "kb", vec(3), 1).hits[0].doc_id == "d3"
    # The next snapshot writes the changes and drops the first one's folder.
    assert _finished(p2 := core.snapshot_begin(tmp_path)) and core.snapshot_finish(p2) and not core.dirty
    again = RetrievalCore(MODEL)
    assert again.restore(tmp_path) and again.position == {0: feed.offset}
    assert again.search("acme", "kb", vec(99), 1).hits[0].doc_id == "late"
    assert len(list((tmp_path / "acme" / "kb").rglob("texts.json"))) == 1


def test_a_failed_snapshot_writer_leaves_the_last_whole_snapshot_and_the_collections_dirty(core, tmp_path,
                                                                                         monkeypatch):
    from workers.retrieval.index import CollectionIndex
    feed = Feed(core)
    feed.put("d0", vec(0))
    core.snapshot(tmp_path)
    feed.put("d1", vec(1))

    def broken(self, directory, position):
        raise OSError("disk full")

    monkeypatch.setattr(CollectionIndex, "snapshot", broken)  # the child is a copy: it fails too
    pending = core.snapshot_begin(tmp_path)
    assert _finished(pending) is False and not core.snapshot_finish(pending)
    assert core.dirty
    back = RetrievalCore(MODEL)
    assert back.restore(tmp_path) and back.position == {0: 1} and len(back.collections[("acme", "kb", MODEL)].index) == 1


def test_a_snapshot_removes_folders_its_manifest_does_not_name(core, tmp_path):
    feed = Feed(core)
    feed.put("d0", vec(0))
    stale = tmp_path / "acme" / "kb" / _space_dir(MODEL) / "left-by-a-killed-writer"
    stale.mkdir(parents=True)
    format1 = tmp_path / "acme" / "kb" / "0123456789ab"  # format 1 kept a collection's snapshot here
    format1.mkdir()
    (format1 / "texts.json").write_text("{}")
    core.snapshot(tmp_path)
    assert not stale.exists() and not format1.exists() and len(list((tmp_path / "acme" / "kb" / _space_dir(MODEL)).iterdir())) == 1


IMAGE = "img/1/int8/p1"
NEW = "m/2/int8/p1"


def ready(feed: Feed, model: str, partitions: int = 2, coll: str = "kb") -> None:
    for p in range(partitions):
        feed.raw(vector_key("acme", coll, model, f"\x00ready:{p}"), {"ready": [p, partitions]})


def test_passages_and_images_of_one_collection_are_searched_by_queries_of_their_own_space(core):
    feed = Feed(core)
    feed.put("passage", vec(1))
    feed.put("photo", vec(1), model=IMAGE, text="a caption")
    assert [h.doc_id for h in core.search("acme", "kb", vec(1), 5).hits] == ["passage"]
    got = core.search("acme", "kb", vec(1), 5, space=IMAGE)
    assert [h.doc_id for h in got.hits] == ["photo"] and got.texts == ["a caption"]
    assert core.has("acme", "kb", IMAGE) and core.has("acme", "kb")


def test_a_new_model_space_answers_only_once_it_holds_the_whole_collection_and_the_old_one_answers_meanwhile():
    core = RetrievalCore("rag/1/int8/p1", CoreLimits(reuse_entries=0, retire_after_s=100.0))
    feed = Feed(core)
    for i in range(6):
        feed.put(f"d{i}", vec(i))
    ready(feed, MODEL)
    for i in range(3):  # the new model's indexer is half-way through the collection
        feed.put(f"d{i}", vec(i + 100), model=NEW)
    assert core.search("acme", "kb", vec(4), 1, space=MODEL).hits[0].doc_id == "d4"  # the old space answers
    with pytest.raises(NotReady):
        core.search("acme", "kb", vec(101), 1, space=NEW)
    ready(feed, NEW, partitions=2)
    ready(feed, NEW, partitions=2)  # markers repeat after a restart: harmless
    with pytest.raises(NotReady):  # one partition marked is not the collection
        feed.raw(vector_key("acme", "kb", "m/3/int8/p1", "\x00ready:0"), {"ready": [0, 2]})
        feed.put("d0", vec(7), model="m/3/int8/p1")
        core.search("acme", "kb", vec(7), 1, space="m/3/int8/p1")
    assert core.search("acme", "kb", vec(101), 1, space=NEW).hits[0].doc_id == "d1"
    # The old space is dropped once it has been neither searched nor changed for retire_after_s,
    # the one in use (searched last) kept, and a re-embed still going kept too.
    now = core.collections[("acme", "kb", NEW)].searched_at
    for key, c in core.collections.items():
        c.updated_at = now
    assert core.retire(now + 50) == []
    core.collections[("acme", "kb", "m/3/int8/p1")].updated_at = now + 90  # still being written
    assert core.retire(now + 100) == [("acme", "kb", MODEL)]
    assert not core.has("acme", "kb", MODEL) and core.has("acme", "kb", NEW)
    assert core.retire(now + 190) == [("acme", "kb", "m/3/int8/p1")]  # given up
    assert core.retire(now + 10_000) == [] and core.has("acme", "kb", NEW)  # the one in use stays
    # A retired space stays retired: a rollback's records cannot make an index of only
    # what came after, and its queries are not told to wait for it.
    feed.put("late", vec(9))
    ready(feed, MODEL)
    assert not core.has("acme", "kb", MODEL) and core.skipped["retired"] >= 3
    with pytest.raises(UnknownCollection):
        core.search("acme", "kb", vec(9), 1, space=MODEL)
    with pytest.raises(UnknownCollection):  # another model's query: no version of it is coming
        core.search("acme", "kb", vec(9), 1, space="audio/1/fp32/p1")


def test_a_delete_reaches_the_old_version_that_still_answers():
    core = RetrievalCore(MODEL, CoreLimits(reuse_entries=0))
    feed = Feed(core)
    feed.put("d", vec(1))
    feed.put("d", vec(1), model=NEW)
    feed.raw(vector_key("acme", "kb", NEW, "d"), None)  # the new indexer's tombstone
    assert len(core.collections[("acme", "kb", MODEL)].index) == 0  # the old index answers without it


def test_the_retrieve_stages_own_space_is_never_retired():
    core = RetrievalCore(MODEL, CoreLimits(retire_after_s=10.0))
    feed = Feed(core)
    feed.put("d", vec(1), model=NEW)
    ready(feed, NEW)
    feed.put("d", vec(1))
    ready(feed, MODEL)
    later = max(c.updated_at for c in core.collections.values()) + 10
    assert core.retire(later) == [] and core.has("acme", "kb", MODEL)


def test_with_no_search_the_highest_version_is_the_one_kept():
    core = RetrievalCore("rag/1/int8/p1", CoreLimits(retire_after_s=10.0))
    feed = Feed(core)
    feed.put("d", vec(1), model=NEW)  # replayed in any order after a restart
    ready(feed, NEW)
    feed.put("d", vec(1))
    ready(feed, MODEL)
    later = max(c.updated_at for c in core.collections.values()) + 10
    assert core.retire(later) == [("acme", "kb", MODEL)]
    assert core.has("acme", "kb", NEW)


def test_readiness_survives_a_snapshot(core, tmp_path):
    feed = Feed(core)
    feed.put("d", vec(1))
    ready(feed, MODEL)
    feed.put("d", vec(2), model=NEW)
    core.snapshot(tmp_path)
    back = RetrievalCore(MODEL)
    assert back.restore(tmp_path) and back.ready("acme", "kb", MODEL) and not back.ready("acme", "kb", NEW)
    with pytest.raises(NotReady):
        back.search("acme", "kb", vec(2), 1, space=NEW)


def test_a_retired_space_makes_the_snapshot_dirty_and_stays_retired_after_a_restore(tmp_path):
    core = RetrievalCore("rag/1/int8/p1", CoreLimits(retire_after_s=10.0))
    feed = Feed(core)
    feed.put("d", vec(1))
    feed.put("d", vec(1), model=NEW)
    ready(feed, MODEL)
    ready(feed, NEW)
    core.snapshot(tmp_path)
    assert not core.dirty
    later = max(c.updated_at for c in core.collections.values()) + 10
    assert core.retire(later) == [("acme", "kb", MODEL)] and core.dirty  # the manifest must say so
    core.snapshot(tmp_path)
    assert not core.dirty
    back = RetrievalCore("rag/1/int8/p1")
    assert back.restore(tmp_path) and back.retired == {("acme", "kb", MODEL)} and not back.dirty
    Feed(back).put("late", vec(2))  # a record of the retired space, replayed: skipped
    assert not back.has("acme", "kb", MODEL) and back.skipped["retired"] == 1
