"""Recall@k of what a retrieve run answered: the check that near-duplicate reuse costs at most
a point of recall on the run's own stream of queries (issue 23), measured end to end.

After the timed run, the bench restores the retrieve replica's latest snapshot of the collection
(the stage writes one within ``retrieval.snapshot_every_s`` of its last change) and embeds the
run's queries with the text encoder the pipeline serves, in this process (the same model,
precision and preprocessing as ``encode.text``, so the same vectors). Per answered query it
takes three top-k lists:

- **exact**: every document scored (``CollectionIndex.exact_search``);
- **plain**: the graph's search as the stage runs it with no reuse cache;
- **answered**: the ids the pipeline returned (searched or reused).

It reports the mean recall@k against exact of the plain and the answered lists, their
difference in points, and the same split by whether the answer was a reuse. Plain and
answered differ only by reuse: the graph, ef and over-fetch are the stage's own, restored
from its snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Sequence

from schemas.settings import Settings

log = logging.getLogger(__name__)

SNAPSHOT_WAIT_S = 60.0
"""How long to wait for a snapshot holding every document (the stage writes one within its
``snapshot_every_s``, 30 s by default, of its last change)."""


def recall(got: Sequence[str], exact: Sequence[str]) -> float:
    """Share of ``exact`` that ``got`` holds (1.0 when ``exact`` is empty)."""
    return len(set(got) & set(exact)) / len(exact) if exact else 1.0


def summarize(rows: Sequence[tuple[float, float, bool]]) -> dict[str, Any]:
    """Rows of (plain recall, answered recall, reused) -> the report's numbers."""
    def mean(xs: list[float]) -> float | None:
        return round(sum(xs) / len(xs), 4) if xs else None

    out: dict[str, Any] = {"queries": len(rows), "plain": mean([p for p, _, _ in rows]),
                           "answered": mean([a for _, a, _ in rows])}
    out["answered_minus_plain_points"] = (round(100 * (out["answered"] - out["plain"]), 2)
                                          if rows else None)
    for label, flag in (("reused", True), ("searched", False)):
        mine = [(p, a) for p, a, r in rows if r is flag]
        out[label] = {"queries": len(mine), "plain": mean([p for p, _ in mine]), "answered": mean([a for _, a in mine])}
    return out


async def recall_report(settings: Settings, collection: str, queries: Sequence[str],
                        answers: Sequence[list[str] | None], reused: Sequence[bool | None], k: int,
                        documents: int) -> dict[str, Any] | None:
    """The recall block of a retrieve run's report, or None (logged) when no snapshot of the
    collection holding ``documents`` could be read in time."""
    embedder = await asyncio.to_thread(_embedder, settings)
    index = await _latest_index(settings, embedder.identity, collection, documents)
    if index is None:
        log.warning("recall not measured: no snapshot of %r holding %d documents", collection, documents)
        return None
    vectors = await asyncio.to_thread(_embed, embedder, list(queries))
    rows = []
    for vec, got, was_reused in zip(vectors, answers, reused):
        if got is None or isinstance(vec, Exception):
            continue
        exact = [h.doc_id for h in index.exact_search(vec, k)]
        plain = [h.doc_id for h in index.search(vec, k)]
        rows.append((recall(plain, exact), recall(got, exact), bool(was_reused)))
    return {"k": k, **summarize(rows)}


def sweep(index: Any, vectors: Sequence[Any], k: int, settings: Sequence[tuple[int, float]],
          max_entries: int) -> list[dict[str, Any]]:
    """The run's queries replayed in order through the reuse cache at each ``(pool size,
    threshold)``, as the retrieve stage would have answered them (``RetrievalCore.search``'s
    path): per setting, the share of searches avoided and recall@k against exact search and
    against plain search. Pure compute over a restored index; no pipeline."""
    from streams.policies.reuse import NearDuplicateCache

    qs = [v for v in vectors if not isinstance(v, Exception)]
    exact = [[h.doc_id for h in index.exact_search(q, k)] for q in qs]
    plain = [recall([h.doc_id for h in index.search(q, k)], e) for q, e in zip(qs, exact)]
    out = []
    for pool, threshold in settings:
        cache = NearDuplicateCache(threshold, max_entries, pool_size=pool)
        got, reused = [], 0
        for q in qs:
            found = cache.lookup(q, k, None, rescore=lambda ids, qv, kk: index.rescore(ids, qv, kk))
            if found is None:
                hits, candidates = index.search_with_pool(q, k, pool_size=pool)
                cache.store(q, k, None, hits, candidates)
            else:
                hits, reused = list(found), reused + 1
            got.append([h.doc_id for h in hits])
        answered = [recall(g, e) for g, e in zip(got, exact)]
        n = len(qs) or 1
        out.append({"pool": pool, "threshold": threshold, "avoided": round(reused / n, 4),
                    "recall_plain": round(sum(plain) / n, 4), "recall_answered": round(sum(answered) / n, 4),
                    "points": round(100 * (sum(answered) - sum(plain)) / n, 2)})
    return out


async def _latest_index(settings: Settings, model: str, collection: str, documents: int) -> Any:
    """The collection's index as the retrieve replica's last whole snapshot holds it, read the
    way the stage itself restores (``RetrievalCore.restore``), once it holds ``documents``."""
    from streams.app import stage_datadir
    from streams.cores.retrieval import RetrievalCore
    from streams.stages.retrieve import SNAPSHOTS, STAGE

    where = stage_datadir(settings, STAGE) / SNAPSHOTS
    deadline = time.monotonic() + SNAPSHOT_WAIT_S
    while True:
        core = RetrievalCore(model)
        if await asyncio.to_thread(core.restore, where):
            found = [c.index for (_, name, space), c in core.collections.items()
                     if name == collection and space == model]
            if found and len(found[0]) >= documents:
                return found[0]
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(2.0)


def _embedder(settings: Settings) -> Any:
    from streams.observe.metrics import Metrics
    from streams.stages.runner import embedder

    return embedder(settings, Metrics(), "bench")


def _embed(embedder: Any, texts: list[str]) -> list[Any]:
    out: list[Any] = []
    for i in range(0, len(texts), 64):
        out += embedder.embed(texts[i:i + 64], "bench-recall")
    return out


SWEEP = ((100, 0.80), (100, 0.85), (100, 0.90), (200, 0.70), (200, 0.75), (200, 0.80), (200, 0.85))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mmstream.bench.retrieval_recall --prefix P --docs N --rate R [--seed S]
    [--repeat X] [--duration D]``: the reuse sweep over the queries a retrieve bench run sent
    (the same flags regenerate them), against the index the run's retrieve stage snapshot
    (its topic prefix ``P``, from the run's log or ``mmstream status``)."""
    import argparse
    import json

    from mmstream.bench.config import BenchConfig
    from mmstream.bench.retrieval_run import COLLECTION, K, _queries
    from workers.retrieval import corpus as C

    ap = argparse.ArgumentParser(prog="python -m mmstream.bench.retrieval_recall")
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--docs", type=int, required=True)
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeat", type=float, default=0.5)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--max-entries", type=int, default=1024)
    args = ap.parse_args(argv)
    settings = Settings.from_env({"MMSTREAM_KAFKA_TOPIC_PREFIX": args.prefix})
    cfg = BenchConfig(workload="retrieve", rate=args.rate, duration_s=args.duration, seed=args.seed,
                      repeat=args.repeat, docs=args.docs)
    held_out = C.load_corpus(limit=args.docs + 1000)[args.docs:]
    _, queries = _queries(cfg, args.rate, held_out)
    embedder = _embedder(settings)
    index = asyncio.run(_latest_index(settings, embedder.identity, COLLECTION, args.docs))
    if index is None:
        print(f"no snapshot of {COLLECTION!r} with {args.docs} documents under prefix {args.prefix}")
        return 1
    rows = sweep(index, _embed(embedder, queries), K, SWEEP, args.max_entries)
    print(json.dumps({"queries": len(queries), "documents": len(index), "sweep": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
