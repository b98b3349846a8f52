"""The retrieval lever's compute, measured on real passages and the project's text encoder:
``python -m mmstream.retrievebench [--docs N] [--queries N] [--libraries] [--out FILE]``.

The corpus is ``workers.retrieval.corpus`` (docstrings, comments and documents of what is
installed); the last ``--queries`` passages are held out of the index and a run of 8-16
words of each is a query. Everything is embedded in-process with the text encoder the
pipeline serves (the model repository's MiniLM at the encoder's precision, rows alone where
that variant needs it), and the passages' embeddings are cached in
``~/.cache/mmstream/retrieval/`` under the corpus fingerprint and the model's identity, so
a rerun embeds only the queries.

What it reports (stdout, one JSON line per section, and ``--out``):

- **libraries** (``--libraries``): faiss-cpu HNSW, hnswlib and USearch on the same vectors:
  build seconds, recall@10 after exact rescoring of a ``k * overfetch`` fetch, search p50/p99,
  memory, snapshot save/load, one thread each.
- **index**: ``CollectionIndex`` as the retrieve stage runs it: recall@10 vs exact top-10,
  search p50/p99 ms, build and snapshot seconds.
- **reuse**: a stream of queries, half of them near-duplicates (``corpus.near_duplicate``)
  of an earlier one, through ``NearDuplicateCache`` per threshold: the share of index
  searches it avoids and recall@10 vs the exact top-10 of the query actually asked, beside
  the same stream with no cache.

Nothing here is asserted: the numbers go to docs/retrieval.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from schemas.settings import Settings
from streams.policies.reuse import NearDuplicateCache
from workers import engines
from workers.encoders import batch_dependent
from workers.engines import EngineOptions
from workers.repository import ModelRepository
from workers.retrieval import corpus as C
from workers.retrieval.index import CollectionIndex, Hit
from workers.text import PREPROCESSING_VERSION, TextEncoder, TextPreprocessor, normalize

K = 10
CACHE_DIR = Path.home() / ".cache" / "mmstream" / "retrieval"
THRESHOLDS = (0.90, 0.93, 0.95, 0.97, 0.99)
BLOCK = 4096
"""Passages embedded per cached block: an interrupted run resumes at its last block."""


class Embedder:
    """The pipeline's text encoder, in-process: what ``encode.text`` would answer."""

    def __init__(self, settings: Settings, threads: int) -> None:
        config = ModelRepository(settings.models.repository).resolve(settings.models.text_model)
        options = EngineOptions.from_settings(settings.encoder)
        options = EngineOptions(intra_op_threads=threads, allow_spinning=False, providers=options.providers)
        self.engine = engines.load_engine(config, settings.encoder.precision, options)
        self.pre = TextPreprocessor(config.tokenizer_path, config.max_length)
        self.encoder = TextEncoder(self.engine, self.pre, embedding_dim=config.embedding_dim)
        self.alone = batch_dependent(config, self.engine.precision)
        self.identity = f"{config.name}-{config.version}-{self.engine.precision}-{PREPROCESSING_VERSION}"
        self.dim = config.embedding_dim

    def embed(self, texts: list[str]) -> np.ndarray:
        rows = [self.pre.ids(normalize(t)) for t in texts]
        if self.alone:  # as the stage runs this variant: each row alone
            out = [self.encoder.embed_ids([r])[0] for r in rows]
        else:
            order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths pad little
            out = [None] * len(rows)
            for s in range(0, len(order), 32):
                batch = order[s:s + 32]
                for i, v in zip(batch, self.encoder.embed_ids([rows[i] for i in batch])):
                    out[i] = v
        return np.stack(out).astype(np.float32) if out else np.zeros((0, self.dim), np.float32)


def load_passages(cache_dir: Path) -> list[C.Passage]:
    """``corpus.load_corpus()``, cached under a digest of every source file's path, size and
    mtime (building it parses about 15k files: minutes on a small box)."""
    h = hashlib.sha256(C.CORPUS_VERSION.encode())
    for root in C.default_roots():
        for path in C.iter_files(root):
            st = path.stat()
            h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    cached = cache_dir / f"corpus-{h.hexdigest()[:16]}.json"
    if cached.exists():
        return [C.Passage(i, t, m) for i, t, m in json.loads(cached.read_text())]
    passages = C.load_corpus()
    cache_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(cached, json.dumps([[p.id, p.text, p.meta] for p in passages]).encode())
    return passages


def embed_passages(embedder: Embedder, passages: list[C.Passage], cache_dir: Path,
                   from_end: bool = False) -> np.ndarray:
    """Unit vectors of ``passages`` in order, from the cache or embedded (block by block,
    each block cached as it is done, so an interrupted run resumes). ``from_end``: the last
    block first (a second process beside a first one shares the work)."""
    key = f"{C.fingerprint(passages)}-{embedder.identity}"
    final = cache_dir / f"emb-{key}.npy"
    if final.exists():
        return np.load(final)
    parts = cache_dir / f"emb-{key}.parts"
    parts.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    starts = list(range(0, len(passages), BLOCK))
    for start in reversed(starts) if from_end else starts:
        path = parts / f"{start // BLOCK:05d}.npy"
        if not path.exists():
            block = embedder.embed([p.text for p in passages[start:start + BLOCK]])
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
            np.save(tmp, block)
            os.replace(tmp, path)
            print(f"embedded passages {start}-{min(start + BLOCK, len(passages))} of {len(passages)} "
                  f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    if final.exists():  # the other process finished first
        return np.load(final)
    vectors = np.concatenate([np.load(parts / f"{start // BLOCK:05d}.npy") for start in starts])
    tmp = final.with_suffix(f".{os.getpid()}.tmp.npy")
    np.save(tmp, vectors)
    os.replace(tmp, final)
    shutil.rmtree(parts, ignore_errors=True)
    return vectors


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
    base query asked before (chosen by ``rng``), through the cache at each threshold."""
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
    plain = [[row[h.doc_id] for h in index.search(v, K)] for v in vecs]
    cos = [float(vecs[n] @ vecs[d]) for n, d in enumerate(dup_of) if d >= 0]
    out: dict[str, Any] = {"queries": len(texts), "near_duplicates": len(cos),
                           "dup_cosine_quartiles": [round(float(c), 3) for c in np.percentile(cos, (25, 50, 75))],
                           "recall_at_10_no_cache": recall(plain, exact), "thresholds": []}
    for threshold in THRESHOLDS:
        cache = NearDuplicateCache(threshold, max_entries)
        got = []
        for v in vecs:
            hits = cache.lookup(v, K)
            if hits is None:
                hits = tuple(index.search(v, K))
                cache.store(v, K, None, hits)
            got.append([row[h.doc_id] for h in hits])
        r = recall(got, exact)
        out["thresholds"].append({"threshold": threshold, "searches_avoided": round(cache.hits / len(texts), 4),
                                  "recall_at_10": r,
                                  "recall_change_points": round(100 * (r - out["recall_at_10_no_cache"]), 2)})
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


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmstream.retrievebench", description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=1000, help="held-out passages queried (default: %(default)s)")
    parser.add_argument("--docs", type=int, default=0, help="index at most this many passages (0: all)")
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
    vectors = embed_passages(embedder, passages, CACHE_DIR, args.embed_from_end)
    if args.embed_only:
        return 0
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
                                          "fingerprint": C.fingerprint(passages), "encoder": embedder.identity}}
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
