"""Where a retrieve stage's search time goes at 100k passages, in-process (no Kafka):
``python -m mmstream.retrievecorebench [--docs N] [--queries N] [--out FILE]``.

A ``RetrievalCore`` with the stage's settings (``schemas.settings_retrieval`` defaults) is fed
``--docs`` passages of the offline corpus (``workers.retrieval.corpus``: real texts and meta,
corpus order, as ``mmstream bench --workload retrieve`` puts them) through ``apply``, the
stage's own path (vector records with fp16 vectors). The vectors are the text encoder's when
``mmstream.retrievebench`` has cached them for this corpus, otherwise synthetic: unit vectors
around 2000 Gaussian centres, 384-d (``--synthetic`` forces them; embedding 100k passages
takes about 35 minutes on this box). Graph search time depends on the graph, not on what the
vectors mean, so the latency numbers hold for either; recall is only reported against exact
search over the same vectors.

A stream of queries (half of them near-duplicates of an earlier one, as the e2e bench asks)
is searched through ``RetrievalCore.search`` under:

- **plain**: no snapshot, reuse on (the default) and off;
- **snapshot, stage as built**: the snapshot's wall time, which is how long the stage's
  searches wait (it holds the stage lock), and each part of it;
- **snapshot in a thread**: searches while another thread writes the snapshot (what the
  searches see of a snapshot that does not hold them up: the GIL it takes);
- **forked snapshot**: searches while ``RetrievalCore.snapshot_begin``'s child process writes
  it (what the stage does since this was measured), and the fork's own pause;
- **gil**: the longest the snapshot's parts keep a probe thread from running;
- **gc**: a full collection's time with the core in memory, and the collections that fall
  into the search stream;
- **wire**: the stage's own work per search around the core (job decode, answer encode).

Nothing is asserted; the numbers go to docs/retrieval.md. Run it with ``OPENBLAS_NUM_THREADS=1``
as the supervisor runs workers.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from schemas.codec import pack, unpack
from schemas.documents import VectorRecord, vector_key
from schemas.events import Event, EventKind
from schemas.jobs import RetrieveJob
from schemas.settings import Settings
from schemas.tensor import from_wire, to_wire
from streams.cores.retrieval import RetrievalCore
from streams.stages.retrieve import core_limits
from workers.retrieval import corpus as C

MODEL = "bench-model"
TENANT, COLLECTION = "default", "bench"
DIM = 384
K = 10


def percentiles(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms, dtype=np.float64)
    return {"n": int(a.size), "p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3),
            "max": round(float(a.max()), 3)} if a.size else {"n": 0}


def synthetic(n: int, rng: np.random.Generator, centres: np.ndarray, spread: float = 0.7) -> np.ndarray:
    """Unit vectors around ``centres``: noise of norm about ``spread`` (cosine about 0.8 with the centre)."""
    noise = rng.standard_normal((n, DIM)).astype(np.float32) * (spread / np.sqrt(DIM))
    x = centres[rng.integers(0, len(centres), n)] + noise
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def near(q: np.ndarray, rng: np.random.Generator, noise: float) -> np.ndarray:
    v = q + noise * rng.standard_normal(DIM).astype(np.float32) / np.sqrt(DIM)
    return (v / np.linalg.norm(v)).astype(np.float32)


def query_stream(held: np.ndarray, n: int, rng: np.random.Generator, repeat: float = 0.5) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for i in range(n):
        if out and rng.random() < repeat:  # a retyped earlier query: cosine about 0.8-0.99 with it
            out.append(near(out[int(rng.integers(0, len(out)))], rng, float(rng.uniform(0.1, 0.7))))
        else:
            out.append(held[i % len(held)])
    return out


def feed(core: RetrievalCore, passages: list[C.Passage], x: np.ndarray) -> float:
    started = time.perf_counter()
    for offset, (p, v) in enumerate(zip(passages, x)):
        rec = VectorRecord(tenant=TENANT, collection=COLLECTION, doc=p.id, model=MODEL, vector=to_wire(v, "float16"),
                           text=p.text, meta=p.meta)
        core.apply(0, offset, vector_key(TENANT, COLLECTION, MODEL, p.id), unpack(pack(rec.to_wire())))
    return time.perf_counter() - started


def time_searches(core: RetrievalCore, queries: list[np.ndarray], until: Callable[[], bool] | None = None
                  ) -> tuple[list[float], int]:
    """Per-search ms over ``queries`` (cycled while ``until`` says go on), and how many reused."""
    ms: list[float] = []
    reused = 0
    i = 0
    while True:
        q = queries[i % len(queries)]
        t0 = time.perf_counter()
        a = core.search(TENANT, COLLECTION, q, K)
        ms.append((time.perf_counter() - t0) * 1e3)
        reused += a.reused
        i += 1
        if until is None and i >= len(queries):
            break
        if until is not None and not until():
            break
    return ms, reused


class GcWatch:
    """The garbage collections that run while it is entered: (generation, ms) each."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seen.append((info["generation"], (time.perf_counter() - self._t0) * 1e3))

    def __enter__(self) -> "GcWatch":
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._cb)

    def summary(self) -> dict[str, Any]:
        out = {}
        for g in (0, 1, 2):
            ms = [m for gg, m in self.seen if gg == g]
            out[f"gen{g}"] = {"count": len(ms), "max_ms": round(max(ms), 2) if ms else 0.0}
        return out


class GilProbe:
    """A thread that asks for the GIL every 0.5 ms: its longest wait is the longest the GIL was held."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.0005)
            now = time.perf_counter()
            self.gaps.append((now - last) * 1e3)
            last = now

    def __enter__(self) -> "GilProbe":
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()

    def worst(self) -> float:
        return round(max(self.gaps), 2) if self.gaps else 0.0


def snapshot_parts(core: RetrievalCore, directory: Path) -> dict[str, Any]:
    """The snapshot's wall time and, for its biggest parts, wall time and longest GIL hold."""
    c = core.collections[(TENANT, COLLECTION, MODEL)]
    idx = c.index
    out: dict[str, Any] = {}
    c.dirty = True
    with GilProbe() as probe:
        t0 = time.perf_counter()
        core.snapshot(directory)
        out["whole_s"] = round(time.perf_counter() - t0, 3)
    out["whole_gil_ms"] = probe.worst()
    scratch = directory / "parts"
    scratch.mkdir(parents=True, exist_ok=True)
    high = len(idx._ids)
    parts: dict[str, Callable[[], Any]] = {
        "vectors np.save": lambda: np.save(scratch / "v.npy", idx._vectors[:high]),
        "docs json": lambda: (scratch / "d.json").write_text(json.dumps(
            [None if d is None else [d, idx._metas[s]] for s, d in enumerate(idx._ids)])),
        "graph save_index": lambda: idx._ann.save_index(str(scratch / "g.hnsw")),
        "texts json": lambda: (scratch / "t.json").write_text(json.dumps({"id": "x", "texts": c.texts})),
    }
    from workers.retrieval.index import _digest
    for name, fn in parts.items():
        with GilProbe() as probe:
            t0 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
        out[name] = {"s": round(wall, 3), "gil_max_ms": probe.worst()}
    with GilProbe() as probe:
        t0 = time.perf_counter()
        for f in ("v.npy", "d.json", "g.hnsw", "t.json"):
            _digest(scratch / f)
        out["sha256 of the files"] = {"s": round(time.perf_counter() - t0, 3), "gil_max_ms": probe.worst()}
    out["bytes"] = {f.name: f.stat().st_size for f in scratch.iterdir()}
    shutil.rmtree(scratch, ignore_errors=True)
    return out


def gc_section(core: RetrievalCore, queries: list[np.ndarray]) -> dict[str, Any]:
    objects = gc.get_objects()
    tracked = len(objects)
    types: dict[str, int] = {}
    for o in objects:
        types[type(o).__name__] = types.get(type(o).__name__, 0) + 1
    del objects
    top = dict(sorted(types.items(), key=lambda kv: -kv[1])[:8])
    t0 = time.perf_counter()
    gc.collect()
    full_ms = (time.perf_counter() - t0) * 1e3
    seen: list[tuple[int, float]] = []
    started: dict[int, float] = {}

    def cb(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            seen.append((info["generation"], (time.perf_counter() - started.get(0, time.perf_counter())) * 1e3))

    gc.callbacks.append(cb)
    try:
        time_searches(core, queries)
    finally:
        gc.callbacks.remove(cb)
    by_gen = {g: [ms for gg, ms in seen if gg == g] for g in (0, 1, 2)}
    gc.freeze()
    t0 = time.perf_counter()
    gc.collect()
    frozen_ms = (time.perf_counter() - t0) * 1e3
    gc.unfreeze()
    return {"tracked_objects": tracked, "top_types": top, "full_collect_after_freeze_ms": round(frozen_ms, 2),
            "full_collect_ms": round(full_ms, 2), "threshold": gc.get_threshold(),
            "in_stream": {str(g): {"count": len(v), "max_ms": round(max(v), 3) if v else 0.0} for g, v in by_gen.items()}}


def breakdown_section(core: RetrievalCore, queries: list[np.ndarray], n: int = 1000) -> dict[str, Any]:
    """One search's parts: the graph walk alone (fetch 100 at ef 128, as a pooled search
    walks), the pooled search (walk + exact rescoring of the pool + hits), a cache lookup."""
    c = core.collections[(TENANT, COLLECTION, MODEL)]
    idx, cache = c.index, core._cache()
    walk, pooled, lookup = [], [], []
    for q in queries[:n]:
        t0 = time.perf_counter()
        idx._ann.knn_query(q, 100, num_threads=1)
        walk.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        hits, pool = idx.search_with_pool(q, K, pool_size=100)
        pooled.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        cache.lookup(q, K, None, rescore=lambda ids, qv, kk: idx.rescore(ids, qv, kk))
        lookup.append((time.perf_counter() - t0) * 1e3)
        cache.store(q, K, None, hits, pool)
    return {"graph walk ms": percentiles(walk), "pooled search ms": percentiles(pooled),
            "cache lookup ms": percentiles(lookup)}


def wire_section(core: RetrievalCore, queries: list[np.ndarray], n: int = 500) -> dict[str, Any]:
    """The stage's per-search work around the core: the job decoded, the answer encoded."""
    now = time.time() * 1e3
    job = RetrieveJob(id="r1", lane="rt", tenant=TENANT, reply_to="mm.results", deadline_at_ms=now + 30_000,
                      accepted_at_ms=now, client_sent_at_ms=now, sent_at_ms=now, collection=COLLECTION, k=K,
                      query=to_wire(queries[0], "float16"), trace=[{"stage": "router", "queued_ms": 1.0,
                                                                    "service_ms": 0.3}] * 3)
    raw = pack(job.to_wire())
    dec, enc = [], []
    for i in range(n):
        t0 = time.perf_counter()
        j = RetrieveJob.from_wire(unpack(raw))
        q = np.asarray(from_wire(j.query), dtype=np.float32).reshape(-1)
        dec.append((time.perf_counter() - t0) * 1e3)
        a = core.search(TENANT, COLLECTION, q, K)
        t0 = time.perf_counter()
        hits = [{"id": h.doc_id, "score": round(float(h.score), 6), "text": t, "meta": h.meta}
                for h, t in zip(a.hits, a.texts)]
        ev = Event(j.id, EventKind.RESULT, 1, now, timings={"e2e_ms": 1.0, "stages": j.trace}, payload={
            "task": "retrieve", "collection": j.collection, "hits": hits, "parts": [],
            "index": {"documents": a.documents, "version": a.epoch, "reused": a.reused}})
        pack(ev.to_wire())
        enc.append((time.perf_counter() - t0) * 1e3)
    return {"job decode + query from_wire ms": percentiles(dec), "answer event + pack ms": percentiles(enc)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmstream.retrievecorebench", description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--sections", default="plain,breakdown,snapshot,threaded,forked,gc,wire")
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    rng = np.random.default_rng(args.seed)
    from mmstream.retrievebench_corpus import CACHE_DIR, load_passages
    passages = load_passages(CACHE_DIR)[:args.docs + 1000]
    docs, held_texts = passages[:args.docs], passages[args.docs:]
    centres = rng.standard_normal((2000, DIM)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = synthetic(len(docs), rng, centres)
    held = synthetic(1000, rng, centres)
    core = RetrievalCore(MODEL, core_limits(Settings()))
    report: dict[str, Any] = {"docs": len(docs), "vectors": "synthetic", "limits": repr(core.limits)}
    report["build_s"] = round(feed(core, docs, x), 1)
    del passages, docs, held_texts, x  # what the stage holds is the core, not the corpus
    gc.collect()
    print(json.dumps({"build_s": report["build_s"]}), flush=True)
    queries = query_stream(held, args.queries, rng)
    c = core.collections[(TENANT, COLLECTION, MODEL)]
    exact = [set(h.doc_id for h in c.index.exact_search(q, K)) for q in queries[:300]]
    got = [set(h.doc_id for h in c.index.search(q, K)) for q in queries[:300]]
    report["recall@10 vs exact (first 300 queries, no reuse)"] = round(
        float(np.mean([len(a & b) / K for a, b in zip(got, exact)])), 4)
    time_searches(core, queries[:200])  # warm
    if "plain" in sections:
        for rnd in (1, 2):  # the first round fills the cache: its entries are new long-lived objects
            c.cache = core._cache() if rnd == 1 else c.cache
            with GcWatch() as w:
                ms, reused = time_searches(core, queries)
            report[f"plain, reuse on, round {rnd}"] = {**percentiles(ms), "reused": reused, "gc": w.summary()}
        cache, c.cache = c.cache, None
        with GcWatch() as w:
            ms, _ = time_searches(core, queries)
        report["plain, reuse off"] = {**percentiles(ms), "gc": w.summary()}
        c.cache = cache
        print(json.dumps({k: v for k, v in report.items() if k.startswith("plain")}), flush=True)
    with tempfile.TemporaryDirectory(prefix="retrievecorebench-") as tmp:
        if "snapshot" in sections:
            report["snapshot, stage as built"] = snapshot_parts(core, Path(tmp) / "a")
            print(json.dumps({"snapshot": report["snapshot, stage as built"]}), flush=True)
        if "threaded" in sections:
            for label in ("reuse on", "reuse off"):
                if label == "reuse on":
                    c.cache = core._cache()
                else:
                    c.cache = None
                c.dirty = True
                t = threading.Thread(target=core.snapshot, args=(Path(tmp) / "b",))
                t0 = time.perf_counter()
                t.start()
                ms, _ = time_searches(core, queries, until=t.is_alive)
                t.join()
                report[f"searches during a snapshot in a thread, {label}"] = {
                    **percentiles(ms), "snapshot_s": round(time.perf_counter() - t0, 3)}
            c.cache = core._cache()
            print(json.dumps({k: v for k, v in report.items() if k.startswith("searches during")}), flush=True)
        if "forked" in sections:
            # What the stage does now: snapshot_begin forks, searches go on while the child writes.
            for label in ("reuse on", "reuse off"):
                c.cache = core._cache() if label == "reuse on" else None
                c.dirty = True
                t0 = time.perf_counter()
                pending = core.snapshot_begin(Path(tmp) / "c")
                fork_ms = (time.perf_counter() - t0) * 1e3
                with GcWatch() as w:
                    ms, _ = time_searches(core, queries, until=lambda: pending.poll() is None)
                ok = core.snapshot_finish(pending)
                report[f"searches during a forked snapshot, {label}"] = {
                    **percentiles(ms), "fork_ms": round(fork_ms, 2), "snapshot_s": round(time.perf_counter() - t0, 3),
                    "written": ok, "gc": w.summary()}
            c.cache = core._cache()
            print(json.dumps({k: v for k, v in report.items() if k.startswith("searches during a forked")}), flush=True)
    if "gc" in sections:
        report["gc"] = gc_section(core, queries)
        print(json.dumps({"gc": report["gc"]}), flush=True)
    if "breakdown" in sections:
        report["breakdown"] = breakdown_section(core, queries)
        print(json.dumps({"breakdown": report["breakdown"]}), flush=True)
    if "wire" in sections:
        report["wire"] = wire_section(core, queries)
        print(json.dumps({"wire": report["wire"]}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
