"""The retrieval lever's compute, measured on real passages and the project's text encoder:
``python -m mmstream.retrievebench [--passages N] [--docs N] [--queries N] [--libraries] [--out FILE]``.

The corpus is ``workers.retrieval.corpus`` (docstrings, comments and documents of what is
installed), taken in a fixed pseudo-random order (``embed_order``): ``--passages N`` uses the
first N, a sample of the whole, and a later run of more passages embeds only the rest. Of
the passages used, ``--queries`` (a seeded sample) are held out of the index and a run of
8-16 words of each is a query. Everything is embedded in-process with the text encoder the
pipeline serves (the model repository's MiniLM at the encoder's precision, rows alone where
that variant needs it), and the passages' embeddings are cached block by block in
``~/.cache/mmstream/retrieval/`` under the corpus fingerprint and the model's identity, so
a rerun embeds only the queries.

What it reports (stdout, one JSON line per section, and ``--out``):

- **libraries** (``--libraries``): faiss-cpu HNSW, hnswlib and USearch on the same vectors:
  build seconds, recall@10 after exact rescoring of a ``k * overfetch`` fetch, search p50/p99,
  memory, snapshot save/load, one thread each.
- **index**: ``CollectionIndex`` as the retrieve stage runs it: recall@10 vs exact top-10,
  search p50/p99 ms, build and snapshot seconds.
- **reuse**: a stream of queries, half of them near-duplicates (``corpus.near_duplicate``)
  of an earlier one, through ``NearDuplicateCache`` per candidate pool size and threshold:
  the share of index searches it avoids, recall@10 vs the exact top-10 of the query actually
  asked (against plain search and against the same pooled searches without reuse), and the
  time of a reuse answer and of a search through the cache.

Nothing here is asserted: the numbers go to docs/retrieval.md. Run it with
``OPENBLAS_NUM_THREADS=1``: on a busy box OpenBLAS's threads make one matrix-vector product
over a few thousand cached queries take milliseconds instead of tens of microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from schemas.settings import Settings
from streams.policies.reuse import NearDuplicateCache
from workers.retrieval import corpus as C
from mmstream.retrievebench_corpus import CACHE_DIR, Embedder, embed_order, embed_passages, load_passages
from workers.retrieval.index import CollectionIndex

K = 10
THRESHOLDS = (0.90, 0.93, 0.95, 0.97, 0.99)
POOL_SIZES = (0, 40, 100, 200)
"""Candidates kept per cached entry; 0: the hits only, answered as they are (no rescoring)."""
REUSE_THRESHOLDS = {0: THRESHOLDS, 40: (0.80, 0.85, 0.90, 0.95), 100: (0.75, 0.80, 0.85, 0.88, 0.90, 0.93, 0.95),
                    200: (0.70, 0.75, 0.80, 0.85, 0.90)}


def exact_top(x: np.ndarray, queries: np.ndarray, k: int = K) -> list[set[int]]:
    """Row numbers of the exact top ``k`` of each query (dot products of unit vectors)."""
    out: list[set[int]] = []
    for s in range(0, len(queries), 256):
        scores = queries[s:s + 256] @ x.T
        out.extend(set(row.tolist()) for row in np.argpartition(-scores, k, axis=1)[:, :k])
    return out


def percentiles(ms: list[float]) -> dict[str, float]:
    a = np.array(ms)
    return {"p50_ms": round(float(np.percentile(a, 50)), 3), "p99_ms": round(float(np.percentile(a, 99)), 3)}


def recall(got: list[list[int]], exact: list[set[int]]) -> float:
    return round(float(np.mean([len(set(g) & e) / K for g, e in zip(got, exact)])), 4)


def measure_index(x: np.ndarray, ids: list[str], metas: list[dict], queries: np.ndarray,
                  exact: list[set[int]], threads: int) -> tuple[CollectionIndex, dict[str, Any]]:
    """``CollectionIndex`` built over ``x`` and searched as the retrieve stage will."""
    index = CollectionIndex(x.shape[1], max_docs=len(x), threads=threads)
    started = time.perf_counter()
    for s in range(0, len(x), 10_000):
        index.upsert_many([(ids[i], x[i], metas[i]) for i in range(s, min(s + 10_000, len(x)))])
    build_s = time.perf_counter() - started
    row = {d: i for i, d in enumerate(ids)}
    got, lat = [], []
    for q in queries:
        t = time.perf_counter()
        hits = index.search(q, K)
        lat.append((time.perf_counter() - t) * 1000)
        got.append([row[h.doc_id] for h in hits])
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        index.snapshot(Path(tmp), {"0": len(x)})
        save_s = time.perf_counter() - t
        t = time.perf_counter()
        restored = CollectionIndex.restore(Path(tmp))
        load_s = time.perf_counter() - t
    assert restored is not None
    return index, {"docs": len(x), "build_s": round(build_s, 1), "recall_at_10": recall(got, exact),
                   **percentiles(lat), "memory_mib": round(index.memory_bytes() / 2**20),
                   "snapshot_save_s": round(save_s, 2), "snapshot_load_s": round(load_s, 2),
                   "params": {"overfetch": index.overfetch, **index.library_params}}


def measure_reuse(index: CollectionIndex, x: np.ndarray, ids: list[str], embedder: Embedder,
                  base: list[str], rng: random.Random, max_entries: int) -> dict[str, Any]:
    """A stream of ``2 * len(base)`` queries: each base query, then a near-duplicate of a
    base query asked before (chosen by ``rng``), through the cache at each pool size and
    threshold (``REUSE_THRESHOLDS``). Pool size 0 answers a near hit with the cached hits;
    a pool of N keeps the best N candidates of each search (``search_with_pool``) and answers
    a near hit by rescoring them against the new query (``CollectionIndex.rescore``).

    Recall@10 is against the exact top-10 of the query actually asked; its change is given
    against plain search (what runs with no cache) and against the same pool searches with
    no reuse (a wider fetch finds better hits itself: that part is not reuse's). Times are
    of one query through the cache, split by whether it was a reuse answer or a search."""
    texts: list[str] = []
    dup_of: list[int] = []
    for j, q in enumerate(base):
        texts.append(q)
        dup_of.append(-1)
        i = rng.randrange(j + 1)
        texts.append(C.near_duplicate(base[i], seed=rng.randrange(1 << 30), edits=rng.choice((1, 1, 2))))
        dup_of.append(2 * i)
    vecs = embedder.embed(texts)
    exact = exact_top(x, vecs)
    row = {d: i for i, d in enumerate(ids)}
    plain, plain_ms = [], []
    for v in vecs:
        t = time.perf_counter()
        hits = index.search(v, K)
        plain_ms.append((time.perf_counter() - t) * 1000)
        plain.append([row[h.doc_id] for h in hits])
    cos = [float(vecs[n] @ vecs[d]) for n, d in enumerate(dup_of) if d >= 0]
    folded_repeats = sum(1 for n, d in enumerate(dup_of) if d >= 0 and _fold(texts[n]) == _fold(texts[d]))
    no_cache = recall(plain, exact)
    out: dict[str, Any] = {"queries": len(texts), "near_duplicates": len(cos),
                           "dup_cosine_percentiles_5_10_25_50_75": [
                               round(float(c), 3) for c in np.percentile(cos, (5, 10, 25, 50, 75))],
                           "near_duplicates_that_are_folded_repeats": folded_repeats,
                           "recall_at_10_no_cache": no_cache, "plain_search": percentiles(plain_ms), "runs": []}
    for pool_size in POOL_SIZES:
        pooled = no_cache
        if pool_size:
            pooled = recall([[row[h.doc_id] for h in index.search_with_pool(v, K, pool_size=pool_size)[0]]
                             for v in vecs], exact)
        for threshold in REUSE_THRESHOLDS[pool_size]:
            cache = NearDuplicateCache(threshold, max_entries, pool_size=pool_size)
            rescore = (lambda d, q, k: index.rescore(d, q, k)) if pool_size else None
            got, reuse_ms, search_ms, folded_misses = [], [], [], 0
            seen: set[str] = set()
            for text, v in zip(texts, vecs):
                t = time.perf_counter()
                hits = cache.lookup(v, K, None, rescore)
                if hits is not None:
                    reuse_ms.append((time.perf_counter() - t) * 1000)
                else:
                    hits, pool = index.search_with_pool(v, K, pool_size=pool_size)
                    cache.store(v, K, None, hits, pool if pool_size else None)
                    search_ms.append((time.perf_counter() - t) * 1000)
                    folded_misses += _fold(text) in seen
                seen.add(_fold(text))
                got.append([row[h.doc_id] for h in hits])
            r = recall(got, exact)
            out["runs"].append({"pool_size": pool_size, "threshold": threshold,
                                "searches_avoided": round(cache.hits / len(texts), 4), "recall_at_10": r,
                                "change_vs_no_cache_points": round(100 * (r - no_cache), 2),
                                "change_vs_same_searches_points": round(100 * (r - pooled), 2),
                                "misses_a_folded_text_key_would_hit": folded_misses,
                                "reuse": percentiles(reuse_ms) if reuse_ms else None,
                                "search": percentiles(search_ms)})
            print(json.dumps({"reuse_run": out["runs"][-1]}), flush=True)
    return out


def compare_libraries(x: np.ndarray, queries: np.ndarray, exact: list[set[int]], overfetch: int = 4) -> list[dict]:
    """faiss-cpu, hnswlib and USearch, each at M=16/32, efConstruction 128, ef 64, one
    thread, fetching ``K * overfetch`` and rescoring exactly (as ``CollectionIndex`` does).
    Needs ``pip install faiss-cpu usearch`` beside the pinned hnswlib. USearch is imported
    after ONNX Runtime on purpose: the other order crashes the process (docs/retrieval.md)."""
    import faiss
    import hnswlib
    from usearch.index import Index

    faiss.omp_set_num_threads(1)
    fetch, n, dim = K * overfetch, len(x), x.shape[1]

    def build_faiss():
        ix = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
        ix.hnsw.efConstruction = 128
        ix.add(x)
        ix.hnsw.efSearch = 64
        return ix, lambda q: ix.search(q[None], fetch)[1][0], lambda p: faiss.write_index(ix, p), faiss.read_index

    def build_hnswlib():
        ix = hnswlib.Index("ip", dim)
        ix.init_index(n, M=16, ef_construction=128)
        ix.set_num_threads(1)
        ix.add_items(x, np.arange(n))
        ix.set_ef(64)
        return ix, lambda q: ix.knn_query(q, fetch)[0][0].astype(np.int64), ix.save_index, \
            lambda p: hnswlib.Index("ip", dim).load_index(p)

    def build_usearch(dtype: str):
        ix = Index(ndim=dim, metric="ip", dtype=dtype, connectivity=16, expansion_add=128, expansion_search=64)
        ix.add(np.arange(n), x, threads=1)
        return ix, lambda q: ix.search(q, fetch, threads=1).keys.astype(np.int64), ix.save, Index.restore

    rows = []
    for name, build in (("faiss-cpu HNSWFlat M32", build_faiss), ("hnswlib M16", build_hnswlib),
                        ("usearch f32 M16", lambda: build_usearch("f32")),
                        ("usearch i8 M16", lambda: build_usearch("i8"))):
        before = _rss()
        t = time.perf_counter()
        ix, search, save, load = build()
        build_s = time.perf_counter() - t
        memory = _rss() - before
        got, lat = [], []
        for q in queries:
            t = time.perf_counter()
            cand = np.asarray(search(q))
            cand = cand[np.argsort(-(x[cand] @ q))[:K]]
            lat.append((time.perf_counter() - t) * 1000)
            got.append(cand.tolist())
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            save(f"{tmp}/ix")
            save_s = time.perf_counter() - t
            t = time.perf_counter()
            load(f"{tmp}/ix")
            load_s = time.perf_counter() - t
        rows.append({"library": name, "build_s": round(build_s, 1), "recall_at_10": recall(got, exact),
                     **percentiles(lat), "memory_mib": round(memory), "save_s": round(save_s, 2),
                     "load_s": round(load_s, 2)})
        print(json.dumps({"library": rows[-1]}), flush=True)
        del ix, search, save, load
    return rows


def _rss() -> float:
    """Resident MiB of this process (a build's growth of it: its memory, roughly)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _fold(text: str) -> str:
    """Case, punctuation and whitespace folded: the exact-repeat key measured beside the vector."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.casefold()).split())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmstream.retrievebench", description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=1000, help="held-out passages queried (default: %(default)s)")
    parser.add_argument("--docs", type=int, default=0, help="index at most this many passages (0: all)")
    parser.add_argument("--passages", type=int, default=0,
                        help="use only the first N passages of the embedding order, a seeded sample of the corpus "
                             "(0: all); a later larger run embeds only the rest")
    parser.add_argument("--threads", type=int, default=1, help="encoder threads (default: %(default)s)")
    parser.add_argument("--libraries", action="store_true", help="also compare faiss-cpu, hnswlib and usearch")
    parser.add_argument("--embed-only", action="store_true", help="embed the corpus into the cache and stop")
    parser.add_argument("--embed-from-end", action="store_true",
                        help="embed the last block first (run beside another --embed-only to share the work)")
    parser.add_argument("--index-threads", type=int, default=1, help="graph threads for the build (0: all cores)")
    parser.add_argument("--cache-entries", type=int, default=10_000, help="reuse cache entries (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args(argv)
    settings = Settings.from_env()
    embedder = Embedder(settings, args.threads)
    passages = load_passages(CACHE_DIR)
    print(json.dumps({"corpus": {"passages": len(passages), "fingerprint": C.fingerprint(passages),
                                 "encoder": embedder.identity}}), flush=True)
    ordered = embed_order(passages)
    vectors = embed_passages(embedder, ordered, CACHE_DIR, args.embed_from_end, args.passages or None)
    if args.embed_only:
        return 0
    passages = ordered[:len(vectors)]
    rng = random.Random(args.seed)
    held = set(rng.sample(range(len(passages)), args.queries))
    rows = [i for i in range(len(passages)) if i not in held][:args.docs or None]
    x = np.ascontiguousarray(vectors[rows])
    ids = [passages[i].id for i in rows]
    metas = [passages[i].meta for i in rows]
    queries_text = [C.query_of(passages[i], rng) for i in sorted(held)]
    queries = embedder.embed(queries_text)
    exact = exact_top(x, queries)
    results: dict[str, Any] = {"corpus": {"passages": len(passages), "indexed": len(rows), "queries": len(queries),
                                          "fingerprint": C.fingerprint(passages), "sample_of": C.fingerprint(ordered),
                                          "encoder": embedder.identity}}
    if args.libraries:
        results["libraries"] = compare_libraries(x, queries, exact)
    index, results["index"] = measure_index(x, ids, metas, queries, exact, args.index_threads)
    print(json.dumps({"index": results["index"]}), flush=True)
    results["reuse"] = measure_reuse(index, x, ids, embedder, queries_text, rng, args.cache_entries)
    print(json.dumps({"reuse": results["reuse"]}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
