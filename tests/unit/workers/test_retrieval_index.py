"""CollectionIndex on the real library (hnswlib): exact answers, filters, deletes, snapshots."""

from __future__ import annotations

import json

import numpy as np
import pytest

from workers.retrieval.index import EXACT_FILTER_MAX, CollectionIndex
from workers.retrieval.results import Hit, IndexFullError

DIM = 16


def vectors(n: int, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def brute(x: np.ndarray, ids: list[str], q: np.ndarray, k: int) -> list[str]:
    scores = x @ (q / np.linalg.norm(q))
    return [ids[i] for i in sorted(range(len(ids)), key=lambda i: (-scores[i], ids[i]))[:k]]


@pytest.fixture
def filled() -> tuple[CollectionIndex, np.ndarray, list[str]]:
    x = vectors(2000)
    ids = [f"doc-{i:04d}" for i in range(len(x))]
    index = CollectionIndex(DIM, max_docs=5000)
    index.upsert_many([(d, v, {"group": i % 5, "lang": "en" if i % 2 else "de"}) for i, (d, v) in enumerate(zip(ids, x))])
    return index, x, ids


def test_search_is_the_exact_top_k_in_score_order(filled) -> None:
    index, x, ids = filled
    agree = 0
    for q in vectors(50, seed=1):
        hits = index.search(q, 10)
        scores = [h.score for h in hits]
        assert scores == sorted(scores, reverse=True)
        for h in hits:  # every score is the exact cosine of the stored floats
            assert h.score == pytest.approx(float(x[ids.index(h.doc_id)] @ q), abs=1e-5)
        agree += [h.doc_id for h in hits] == brute(x, ids, q, 10)
    assert agree >= 45  # ANN first pass: nearly always the exact answer at this size


def test_ties_are_ordered_by_doc_id() -> None:
    index = CollectionIndex(DIM)
    v = vectors(1)[0]
    for d in ("c", "a", "b"):
        index.upsert(d, v)
    assert [h.doc_id for h in index.search(v, 3)] == ["a", "b", "c"]


def test_vectors_are_normalised_on_the_way_in() -> None:
    index = CollectionIndex(DIM)
    v = vectors(1)[0]
    index.upsert("x", 7.5 * v)
    np.testing.assert_allclose(index.vector("x"), v, atol=1e-6)
    assert index.search(3 * v, 1)[0].score == pytest.approx(1.0, abs=1e-6)
    assert index.vector("missing") is None


def test_filters_equality_and_any_of(filled) -> None:
    index, x, ids = filled
    q = vectors(1, seed=2)[0]
    hits = index.search(q, 10, where={"group": 3})
    assert len(hits) == 10 and all(h.meta["group"] == 3 for h in hits)
    keep = [i for i in range(len(ids)) if i % 5 == 3]
    assert [h.doc_id for h in hits] == brute(x[keep], [ids[i] for i in keep], q, 10)  # exact under a small filter
    hits = index.search(q, 10, where={"group": [1, 4], "lang": "en"})
    assert all(h.meta["group"] in (1, 4) and h.meta["lang"] == "en" for h in hits)
    assert index.search(q, 10, where={"group": 9}) == []
    assert index.search(q, 10, where={"missing": 1}) == []


def test_a_bool_filter_does_not_match_an_int() -> None:
    index = CollectionIndex(DIM)
    v = vectors(2)
    index.upsert("one", v[0], {"flag": 1})
    index.upsert("true", v[1], {"flag": True})
    assert [h.doc_id for h in index.search(v[0], 5, where={"flag": True})] == ["true"]


def test_a_broad_filter_goes_through_the_graph_and_still_fills_k() -> None:
    n = 2 * EXACT_FILTER_MAX + 500
    x = vectors(n, seed=3)
    index = CollectionIndex(DIM, max_docs=n)
    index.upsert_many([(f"d{i}", x[i], {"half": i % 2}) for i in range(n)])
    for q in vectors(5, seed=4):
        hits = index.search(q, 10, where={"half": 1})
        assert len(hits) == 10 and all(h.meta["half"] == 1 for h in hits)


def test_deleted_ids_are_never_returned(filled) -> None:
    index, x, ids = filled
    q = vectors(1, seed=5)[0]
    top = [h.doc_id for h in index.search(q, 20)]
    for d in top[:10]:
        assert index.delete(d)
    assert not index.delete(top[0])
    assert len(index) == len(ids) - 10
    for where in (None, {"group": [0, 1, 2, 3, 4]}):
        got = {h.doc_id for h in index.search(q, 50, where=where)}
        assert not got & set(top[:10])
    assert index.vector(top[0]) is None
    everything = {h.doc_id for h in index.search(q, len(ids))}
    assert not everything & set(top[:10])


def test_upsert_replaces_vector_and_meta(filled) -> None:
    index, x, ids = filled
    q = vectors(1, seed=6)[0]
    before = len(index)
    index.upsert(ids[0], q, {"group": 99})
    assert len(index) == before
    hit = index.search(q, 1)[0]
    assert hit == Hit(ids[0], pytest.approx(1.0, abs=1e-6), {"group": 99})
    assert index.search(q, 5, where={"group": 0})[0].doc_id != ids[0]  # old meta gone from the filter
    assert [h.doc_id for h in index.search(q, 5, where={"group": 99})] == [ids[0]]


def test_version_bumps_on_every_mutation() -> None:
    index = CollectionIndex(DIM)
    v = vectors(2)
    index.upsert("a", v[0])
    index.upsert("a", v[1])
    index.upsert_many([("b", v[0], None), ("c", v[1], None)])
    assert index.version == 3
    assert index.delete("a") and index.version == 4
    assert not index.delete("a") and index.version == 4


def test_freed_slots_are_reused() -> None:
    index = CollectionIndex(DIM, max_docs=3)
    v = vectors(10)
    for i in range(10):
        index.upsert(f"d{i}", v[i])
        if i >= 2:
            index.delete(f"d{i - 2}")
    assert len(index) == 2
    assert {h.doc_id for h in index.search(v[9], 10)} == {"d8", "d9"}


def test_max_docs_raises_and_changes_nothing() -> None:
    index = CollectionIndex(DIM, max_docs=3)
    v = vectors(5)
    index.upsert_many([(f"d{i}", v[i], None) for i in range(3)])
    with pytest.raises(IndexFullError, match="max_docs=3"):
        index.upsert("d3", v[3])
    with pytest.raises(IndexFullError):
        index.upsert_many([("d0", v[4], None), ("d4", v[4], None)])
    assert len(index) == 3 and index.version == 1
    np.testing.assert_allclose(index.vector("d0"), v[0], atol=1e-6)
    index.upsert("d0", v[4])  # replacing is not growing
    assert index.vector("d0") is not None


def test_bad_input_is_refused_before_anything_changes() -> None:
    index = CollectionIndex(DIM)
    v = vectors(2)
    with pytest.raises(ValueError):
        index.upsert_many([("a", v[0], None), ("b", np.zeros(DIM), None)])
    with pytest.raises(ValueError):
        index.upsert("a", v[0][:3])
    with pytest.raises(TypeError):
        index.upsert("a", v[0], {"x": object()})
    with pytest.raises(ValueError):
        index.search(np.zeros(DIM), 3)
    assert len(index) == 0 and index.version == 0
    with pytest.raises(ValueError):
        CollectionIndex(DIM, no_such_param=1)


def test_snapshot_round_trip_answers_the_same(filled, tmp_path) -> None:
    index, x, ids = filled
    for d in ids[:100]:
        index.delete(d)
    position = {"0": 1234, "1": 99}
    index.snapshot(tmp_path, position)
    restored = CollectionIndex.restore(tmp_path)
    assert restored is not None
    copy, pos = restored
    assert pos == position
    assert len(copy) == len(index) and copy.version == index.version
    for q in vectors(20, seed=7):
        assert copy.search(q, 10) == index.search(q, 10)
        assert copy.search(q, 10, where={"group": 2}) == index.search(q, 10, where={"group": 2})
    np.testing.assert_array_equal(copy.vector(ids[500]), index.vector(ids[500]))
    assert copy.vector(ids[0]) is None
    copy.upsert("new", x[0])  # the restored index keeps working
    assert copy.search(x[0], 1)[0].doc_id == "new"


def test_a_second_snapshot_replaces_the_first(filled, tmp_path) -> None:
    index, x, ids = filled
    index.snapshot(tmp_path, {"0": 1})
    index.delete(ids[0])
    index.snapshot(tmp_path, {"0": 2})
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("snap-")]) == 1
    copy, pos = CollectionIndex.restore(tmp_path)
    assert pos == {"0": 2} and ids[0] not in copy


def test_absent_or_corrupt_snapshot_restores_none(filled, tmp_path) -> None:
    index, _, _ = filled
    assert CollectionIndex.restore(tmp_path / "nothing") is None
    index.snapshot(tmp_path, {"0": 5})
    snap = next(p for p in tmp_path.iterdir() if p.name.startswith("snap-"))
    graph = snap / "graph.hnsw"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    assert CollectionIndex.restore(tmp_path) is None
    (snap / "manifest.json").write_text("{not json")
    assert CollectionIndex.restore(tmp_path) is None
    (tmp_path / "CURRENT").write_text("snap-elsewhere\n")
    assert CollectionIndex.restore(tmp_path) is None


def test_snapshot_of_another_format_restores_none(filled, tmp_path) -> None:
    index, _, _ = filled
    index.snapshot(tmp_path, {})
    snap = next(p for p in tmp_path.iterdir() if p.name.startswith("snap-"))
    manifest = json.loads((snap / "manifest.json").read_text())
    manifest["format"] = 0
    (snap / "manifest.json").write_text(json.dumps(manifest))
    assert CollectionIndex.restore(tmp_path) is None


def test_an_empty_index_snapshots_and_searches(tmp_path) -> None:
    index = CollectionIndex(DIM)
    assert index.search(vectors(1)[0], 5) == []
    index.snapshot(tmp_path, {"0": 0})
    copy, pos = CollectionIndex.restore(tmp_path)
    assert len(copy) == 0 and pos == {"0": 0} and copy.search(vectors(1)[0], 5) == []


def test_search_with_pool_returns_the_hits_and_the_wider_rescored_pool(filled) -> None:
    index, x, ids = filled
    agree = 0
    for q in vectors(20, seed=3):
        hits, pool = index.search_with_pool(q, 5, pool_size=60)
        assert len(pool) == 60 and [h.doc_id for h in hits] == [c.doc_id for c in pool[:5]]
        assert [c.score for c in pool] == sorted((c.score for c in pool), reverse=True)
        for c in pool:
            assert c.score == pytest.approx(float(x[ids.index(c.doc_id)] @ q), abs=1e-5)
        agree += len({c.doc_id for c in pool} & set(brute(x, ids, q, 60)))
    assert agree >= 0.95 * 20 * 60  # the fetch (and ef) widen to the pool: nearly the exact top 60
    assert len(index.search_with_pool(vectors(1)[0], 5)[1]) == 5  # no pool_size: the hits only


def test_search_with_pool_under_a_selective_filter_is_exact(filled) -> None:
    index, x, ids = filled
    q = vectors(1, seed=4)[0]
    hits, pool = index.search_with_pool(q, 3, where={"group": 2}, pool_size=20)
    group = [i for i in range(len(ids)) if i % 5 == 2]
    assert [c.doc_id for c in pool] == brute(x[group], [ids[i] for i in group], q, 20)
    assert [h.doc_id for h in hits] == [c.doc_id for c in pool[:3]]


def test_rescore_ranks_the_given_ids_exactly_for_the_new_query(filled) -> None:
    index, x, ids = filled
    q = vectors(1, seed=5)[0]
    some = ids[:300]
    hits = index.rescore(some + some[:10], q, 7)  # a repeated id counts once
    assert [h.doc_id for h in hits] == brute(x[:300], some, q, 7)
    assert hits[0].meta == index.meta(hits[0].doc_id)
    assert index.rescore(some, q, 0) == [] and index.rescore([], q, 3) == []
    assert index.rescore(["absent"], q, 3) == []


def test_rescore_skips_deleted_ids_and_applies_the_filter(filled) -> None:
    index, x, ids = filled
    q = x[10]
    index.delete(ids[10])
    got = index.rescore(ids[:50], q, 50)
    assert ids[10] not in {h.doc_id for h in got} and len(got) == 49
    en = index.rescore(ids[:50], q, 50, where={"lang": "en"})
    assert {h.doc_id for h in en} == {ids[i] for i in range(50) if i % 2 and i != 10}
    assert index.rescore(ids[:50], q, 50, where={"lang": ["en", "de"], "group": 1}) == \
        [h for h in got if h.meta["group"] == 1]


def test_rescore_of_a_pool_for_its_own_query_gives_the_search_hits(filled) -> None:
    index, _, _ = filled
    for q in vectors(10, seed=6):
        hits, pool = index.search_with_pool(q, 10, pool_size=50)
        assert index.rescore([c.doc_id for c in pool], q, 10) == hits


def test_the_index_adds_no_garbage_collected_objects_per_document_or_meta_value():
    """A full collection walks every tracked object: at 100k passages a posting set per meta
    value made it 90 ms (docs/retrieval.md). Postings, ids and metas must not be tracked."""
    import gc
    x = vectors(3000, seed=7)
    index = CollectionIndex(DIM, max_docs=5000)
    gc.collect()
    before = len(gc.get_objects())
    index.upsert_many([(f"d{i}", v, {"source": f"file-{i}.py", "package": f"p{i % 7}"}) for i, v in enumerate(x)])
    index.delete("d5")
    gc.collect()
    assert len(gc.get_objects()) - before < 100  # 3000 distinct sources, 7 packages
    assert {h.doc_id for h in index.search(x[9], 3, where={"source": ["file-9.py", "file-5.py"]})} == {"d9"}
    assert len(index.search(x[0], 50, where={"package": "p0"})) == 50
