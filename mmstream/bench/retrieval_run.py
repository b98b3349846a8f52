"""`mmstream bench --workload retrieve|rag`: retrieval through the whole pipeline.

Both run on a pipeline of their own (router, assembler, encode.text, index, retrieve; rag
adds the generator), fill one collection with ``cfg.docs`` real passages of the offline
corpus (``workers.retrieval.corpus``, through the documents topic, the indexing stage and
the vectors topic, as a user would) and wait until the retrieve stage holds all of them.

- ``retrieve``: open-loop Poisson retrieve requests at each rate; the queries are runs of
  8-16 words of passages not indexed, and a ``cfg.repeat`` share of them retype an earlier
  query (``corpus.near_duplicate``). Reported: e2e percentiles (the standard run JSON), the
  retrieve stage's service time, and the share answered by reuse.
- ``rag``: the same open-loop generate requests (a question, ``collection``, ``k``) against
  three pipelines, the prefix cache on, off (``generator.prefix_cache_mb`` 0) and off again
  (the control: how often two runs without the cache agree), with
  questions drawn from a few topics so that requests retrieve the same passages; reported:
  TTFT per pipeline, their ratio, and whether the answers agree.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from typing import Any

from mmstream.bench.config import BenchConfig
from mmstream.bench.results import Record, build_run
from mmstream.bench.retrieval_recall import recall_report
from mmstream.bench.run import _pipeline_record, send_and_drain
from mmstream.bench.workloads import arrival_offsets
from mmstream.levers import own_pipeline
from mmstream.stats import summary
from schemas.request import Lane, Modality, Params, Part, Request, Task
from schemas.settings import Settings
from streams.sdk.client import Client, new_id
from streams.connection import KafkaSecurity, client_kwargs
from streams.topics import collection_spec, ensure_topics
from workers.retrieval import corpus as C

COLLECTION = "bench"
K = 10
RAG_K = 3
PUT_CHUNK = 500


async def run_retrieval(settings: Settings, cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    passages = C.load_corpus(limit=cfg.docs + 1000)
    docs, held_out = passages[:cfg.docs], passages[cfg.docs:]
    if cfg.workload == "retrieve":
        async with own_pipeline(settings, cfg.levers_off, "retrieve", extra_env=_env()) as s:
            await _fill(s, docs, progress)
            runs = [await _retrieve_run(s, cfg, rate, held_out, progress, len(docs))
                    for rate in (cfg.rates or (cfg.rate,))]
        return {"workload": "retrieve", "documents": len(docs), "runs": runs}
    out: dict[str, Any] = {"workload": "rag", "documents": len(docs), "runs": []}
    lm = {"MMSTREAM_GENERATOR_PRECISION": cfg.lm_precision} if cfg.lm_precision else {}
    off_env = {"MMSTREAM_GENERATOR_PREFIX_CACHE_MB": "0"}
    # The second pipeline without the cache is the control: answers that differ between two
    # runs of the same code and traffic are the engine's, not the cache's.
    for label, env in (("prefix cache on", {}), ("prefix cache off", off_env), ("prefix cache off, again", off_env)):
        async with own_pipeline(settings, cfg.levers_off, "rag", extra_env={**_env(), **lm, **env}) as s:
            await _fill(s, docs, progress)
            run = await _rag_run(s, cfg, cfg.rate, docs, progress)
            run["label"] = label
            out["runs"].append(run)
    on, off = (r["ttft_ms"] for r in out["runs"][:2])
    out["ttft_p50_off_over_on"] = round(off["p50"] / on["p50"], 2) if on.get("p50") and off.get("p50") else None
    answers = [r.pop("answers") for r in out["runs"]]
    out["same_answers"], out["compared_answers"] = agreement(answers[0], answers[1])
    out["same_answers_off_vs_off"], out["compared_answers_off_vs_off"] = agreement(answers[1], answers[2])
    return out


def agreement(a: list[str | None], b: list[str | None]) -> tuple[int, int]:
    """(same, compared): of the requests both runs answered, how many got the same text."""
    both = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return sum(x == y for x, y in both), len(both)


def _env() -> dict[str, str]:
    return {"MMSTREAM_ROUTER_TOPIC_CACHE_S": "1", "MMSTREAM_ADMISSION_MAX_QUEUED_MS_RT": "5000"}


def client_of(s: Settings) -> Client:
    return Client(s.kafka.bootstrap, s.kafka.topic_prefix, security=KafkaSecurity.from_settings(s.kafka))


async def search_run(s: Settings, cfg: BenchConfig, rate: float, offsets: list[float], requests: list[Request],
                     kind: str, progress: bool) -> tuple[dict[str, Any], list[dict[str, Any] | None]]:
    """Send retrieve ``requests`` open loop at ``offsets``; returns the standard run JSON with
    ``retrieval`` (the retrieve stage's service time and the share answered by reuse) and each
    request's result payload (None when it was not answered with a result), in send order."""
    async with client_of(s) as client:
        pairs, sent_s = await send_and_drain(client, offsets, requests, cfg, progress)
    records = [_pipeline_record(req, sub) for req, sub in pairs]
    for rec in records:
        rec.kind = kind
    run = build_run("pipeline", cfg, rate, records, sent_s, {}, {})
    service = [st["service_ms"] for r in records for st in r.stages if st.get("stage") == "retrieve"]
    results = [(sub.terminal.payload or {}) if sub.terminal is not None and sub.terminal.kind == "result" else None
               for _, sub in pairs]
    answered = [p for p in results if p is not None]
    reused = sum(bool((p.get("index") or {}).get("reused")) for p in answered)
    run["retrieval"] = {"k": K, "near_duplicate_share": cfg.repeat, "retrieve_service_ms": summary(service),
                        "reused_share": round(reused / len(answered), 4) if answered else None}
    return run, results


async def _fill(s: Settings, docs: list[C.Passage], progress: bool) -> None:
    """Every document through the documents topic; returns once a search sees all of them."""
    await ensure_topics(s.kafka.bootstrap, [collection_spec(s.kafka, "default", COLLECTION)],
                        s.kafka.replication_factor, client_kwargs(s))
    started = time.monotonic()
    async with client_of(s) as client:
        for i in range(0, len(docs), PUT_CHUNK):  # bounded: the producer's buffer, not 100k sends at once
            await asyncio.gather(*(client.put_document(COLLECTION, p.id, p.text, p.meta)
                                   for p in docs[i:i + PUT_CHUNK]))
        while True:
            ev = await (await client.retrieve(COLLECTION, "probe", k=1, deadline_ms=30_000)).result(timeout_s=60)
            held = ((ev.payload or {}).get("index") or {}).get("documents", 0)
            if held >= len(docs):
                break
            if progress:
                print(f"\rindexed {held}/{len(docs)} ({time.monotonic() - started:.0f} s)", end="", file=sys.stderr)
            await asyncio.sleep(2.0)
    if progress:
        print(f"\rindexed {len(docs)} documents in {time.monotonic() - started:.1f} s", file=sys.stderr)


def _queries(cfg: BenchConfig, rate: float, held_out: list[C.Passage]) -> tuple[list[float], list[str]]:
    rng = random.Random(f"{cfg.seed}:{rate}:retrieve")
    offsets = arrival_offsets(rate, cfg.duration_s, rng)
    queries: list[str] = []
    for i in range(len(offsets)):
        if queries and rng.random() < cfg.repeat:
            queries.append(C.near_duplicate(rng.choice(queries), seed=rng.randrange(1 << 30)))
        else:
            queries.append(C.query_of(held_out[i % len(held_out)], rng))
    return offsets, queries


async def _retrieve_run(s: Settings, cfg: BenchConfig, rate: float, held_out: list[C.Passage],
                        progress: bool, documents: int) -> dict[str, Any]:
    offsets, queries = _queries(cfg, rate, held_out)
    requests = [Request(id=new_id(), parts=(Part(Modality.TEXT, text=q),), task=Task.RETRIEVE,
                        params=Params(collection=COLLECTION, k=K), lane=Lane(cfg.lane)) for q in queries]
    run, results = await search_run(s, cfg, rate, offsets, requests, "retrieve", progress)
    reused = [(p.get("index") or {}).get("reused") if p is not None else None for p in results]
    answers = [[str(h.get("id")) for h in p.get("hits") or ()] if p is not None else None for p in results]
    run["retrieval"]["recall"] = await recall_report(s, COLLECTION, list(queries), answers, reused, K, documents)
    return run


RAG_ASKS = ("Please explain", "Tell me briefly", "In one sentence:", "Quick question -", "I wonder")
RAG_TOPICS = ("how do I read a file line by line", "what does a context manager do",
              "how are exceptions raised and caught", "how do I parse command line arguments",
              "what is a generator function")


async def _rag_run(s: Settings, cfg: BenchConfig, rate: float, docs: list[C.Passage],
                   progress: bool) -> dict[str, Any]:
    rng = random.Random(f"{cfg.seed}:{rate}:rag")
    offsets = arrival_offsets(rate, cfg.duration_s, rng)
    # A few topics asked again and again: requests that retrieve the same passages share
    # their prompt prefix, which is what the prefix cache can reuse.
    # Worded differently each time (the question is not what the cache should reuse: the
    # passages ahead of it are).
    questions = [f"{rng.choice(RAG_ASKS)} {rng.choice(RAG_TOPICS)}?" for _ in offsets]
    requests = [Request(id=new_id(), parts=(Part(Modality.TEXT, text=q),), task=Task.GENERATE,
                        params=Params(max_tokens=cfg.chat_max_tokens, collection=COLLECTION, k=RAG_K),
                        lane=Lane(cfg.lane), deadline_ms=120_000) for q in questions]
    async with client_of(s) as client:
        pairs, sent_s = await send_and_drain(client, offsets, requests, cfg, progress)
    records: list[Record] = [_pipeline_record(req, sub) for req, sub in pairs]
    for rec in records:
        rec.kind = "rag"
    run = build_run("pipeline", cfg, rate, records, sent_s, {}, {})
    ok = [(req, sub.terminal) for req, sub in pairs if sub.terminal is not None and sub.terminal.kind == "result"]
    run["ttft_ms"] = summary([r.ttft_ms for r in records if r.ttft_ms is not None])
    run["cached_prompt_tokens"] = summary([float((t.payload or {}).get("tokens", {}).get("cached", 0)) for _, t in ok])
    run["answers"] = [(sub.terminal.payload or {}).get("text") if sub.terminal is not None and sub.terminal.kind == "result"
                      else None for _, sub in pairs]
    return run
