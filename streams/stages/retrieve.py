"""The retrieve stage: searches of a tenant's collections in, hits (or a grounded generate
job) out. Thin glue around ``streams.cores.retrieval.RetrievalCore``.

Two inputs:
- ``<p>.vectors``, read whole by every replica (assigned, no group: each replica holds every
  index, like a global table): each record is applied to the core. On start the core is
  restored from its last snapshot and the topic read from that position; searches wait until
  the replica has caught up with the end of the topic as it was when it started.
- ``<p>.retrieve.<lane>`` (its consumer group, rt first): ``RetrieveJob`` s from the
  assembler. A ``retrieve`` job carries its query's embedding from the encoder pool and the
  identity of the encoder that made it (``space``): a text query searches the collection's
  passages, an image query its images, each in the space of the query's model version; a
  retrieval-augmented ``generate`` job carries its question, embedded here with the text
  encoder (``workers.retrieval.embed``). A query in a space still being re-embedded (a
  model change) while another version of its model is ready for the collection is refused
  as ``overloaded`` with ``retry_after_ms``, never answered from part of the collection.

Answers, exactly once like the generator's: the ``result`` (or ``error``) event on the
job's reply topic, or for RAG the ``GenerateJob`` with its passages on
``<p>.generate.<lane>``, and with it a done marker on ``<p>.retrieve.done``; the job record is
finished only when both are with the broker, and a replica taking over a partition reads
the markers first (``streams.runtime.recovery``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import faust
import numpy as np
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from schemas.codec import DecodeError, unpack
from schemas.errors import ErrorCode, WireError
from schemas.events import Event, EventKind
from schemas.jobs import GenerateJob, RetrieveJob, request_key
from schemas.settings import Settings
from schemas.tensor import from_wire
from schemas.trace import now_ms
from streams.app import topic_names
from streams.cores.retrieval import Answer, CoreLimits, NotReady, RetrievalCore, UnknownCollection
from streams.observe.metrics import Metrics
from streams.observe.metrics_retrieval import RetrievalMetrics
from streams.runtime.heap import freeze_heap
from streams.runtime.produce import Out, out_map
from streams.runtime.recovery import AnswerLedger, recover, stage_timings
from streams.runtime.stage import RecordStage
from workers.retrieval.embed import Embedder

log = logging.getLogger(__name__)
STAGE = "retrieve"
TERMINAL_SEQ = 1  # seq 0 is the router's `accepted`
DONE_RETENTION_MS = 600_000.0
SNAPSHOT_WRITER_MAX_S = 600.0
"""A snapshot writer still running after this is killed (100k passages take ~2 s to write)."""
VECTORS_BATCH = 2000
REEMBED_RETRY_MS = 5000
RETIRE_EVERY_S = 60.0


SNAPSHOTS = "retrieval"
"""The directory under the replica's datadir (``streams.app.stage_datadir``) its snapshots go to."""


def core_limits(settings: Settings) -> CoreLimits:
    r = settings.retrieval
    return CoreLimits(max_docs=r.max_docs, max_collections=r.max_collections, overfetch=r.overfetch,
                      ef=r.ef_search, reuse_threshold=r.reuse_threshold, reuse_entries=r.reuse_entries,
                      reuse_pool=r.reuse_pool, retire_after_s=r.retire_after_s)


class RetrieveStage(RecordStage):
    stage = STAGE

    def __init__(self, app: faust.App, settings: Settings, metrics: Metrics, core: RetrievalCore,
                 embedder: Embedder | None) -> None:
        names = topic_names(settings)
        super().__init__(app, settings, [names.retrieve("rt")], [names.retrieve("bulk")])
        self.metrics = metrics
        self.rmetrics = RetrievalMetrics(metrics)
        self.core, self.embedder = core, embedder
        self.r = settings.retrieval
        self.lock = asyncio.Lock()
        """Held around every use of the core: the vectors loop, searches and a snapshot's fork."""
        self.ready = asyncio.Event()
        self.snapshots = Path(app.conf.datadir) / SNAPSHOTS
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine-retrieve")
        self.answers = AnswerLedger(names.retrieve_done, DONE_RETENTION_MS)
        self.lag = 0

    # -- the vectors topic ---------------------------------------------------------------

    async def on_started(self) -> None:
        await super().on_started()
        self.supervise("vectors", self._vectors_forever)
        self.supervise("retire", self._retire_forever)
        if self.r.snapshot_every_s > 0:
            self.supervise("snapshots", self._snapshots_forever)

    async def _vectors_forever(self) -> None:
        k = self.settings.kafka
        if not self.ready.is_set():
            restored = await asyncio.get_running_loop().run_in_executor(self.executor, self.core.restore,
                                                                        self.snapshots)
            log.info("retrieve: %s", f"restored {len(self.core.collections)} collections at {self.core.position}"
                     if restored else "no snapshot: reading the vectors topic from the start")
        consumer = AIOKafkaConsumer(bootstrap_servers=k.bootstrap, enable_auto_commit=False, group_id=None,
                                    auto_offset_reset="earliest", max_partition_fetch_bytes=k.max_message_bytes,
                                    fetch_max_bytes=max(k.max_message_bytes, 52_428_800),
                                    **self.io.settings.client_kwargs)
        try:  # a start that fails is stopped too: a supervised restart must not leave a client per try
            await consumer.start()
            await consumer._client.force_metadata_update()  # a fresh client may not know the topic yet
            tps = [TopicPartition(self.names.vectors, p)
                   for p in sorted(consumer.partitions_for_topic(self.names.vectors) or set())]
            consumer.assign(tps)
            for tp in tps:
                if tp.partition in self.core.position:
                    consumer.seek(tp, self.core.position[tp.partition])
                else:
                    await consumer.seek_to_beginning(tp)
            target = await consumer.end_offsets(tps)
            checked = time.monotonic()
            while not self.should_stop:
                batches = await consumer.getmany(timeout_ms=200, max_records=VECTORS_BATCH)
                if batches:
                    async with self.lock:
                        for tp, recs in batches.items():
                            for rec in recs:
                                self.core.apply(tp.partition, rec.offset, rec.key, _decoded(rec.value))
                if not self.ready.is_set() and await _caught_up(consumer, tps, target):
                    # What the replica built so far lives as long as it does: out of the
                    # collector's reach, a full collection walks only what came after (at
                    # 100k passages it walked the whole index: docs/retrieval.md).
                    freeze_heap()
                    self.ready.set()
                    log.info("retrieve: caught up with %s: %s", self.names.vectors, self.core.stats())
                if time.monotonic() - checked >= 2.0:
                    checked = time.monotonic()
                    # From the last fetch's high watermarks: no request to the broker in the loop.
                    self.lag = 0
                    for tp in tps:
                        high = consumer.highwater(tp)
                        if high is not None:
                            self.lag += max(0, high - await consumer.position(tp))
                    self._note()
        finally:
            await consumer.stop()

    async def _retire_forever(self) -> None:
        while not self.should_stop:
            await asyncio.sleep(RETIRE_EVERY_S)
            async with self.lock:
                for t, n, m in self.core.retire(time.time()):
                    log.info("retrieve: %s/%s: the space of %s is retired (another version of the model is in use)", t, n, m)

    async def _snapshots_forever(self) -> None:
        while not self.should_stop:
            await asyncio.sleep(self.r.snapshot_every_s)
            if self.ready.is_set() and self.core.dirty:
                await self._snapshot()

    async def _snapshot(self) -> None:
        """A forked child writes the snapshot from a copy-on-write image of this process: the
        loop stops only for the fork (milliseconds), searches and the vectors loop go on while
        the child writes (written in-process it held the GIL, and so every search, for about
        a second at 100k passages: docs/retrieval.md)."""
        started = time.monotonic()
        async with self.lock:  # between two applied batches: the state the position says
            pending = self.core.snapshot_begin(self.snapshots)
        forked = time.monotonic() - started
        while pending.poll() is None:
            if time.monotonic() - started > SNAPSHOT_WRITER_MAX_S and pending.pid is not None:
                # a writer that hangs (a lock some thread held at the fork) must not stop every later
                # snapshot: kill it; its result is then a failure and the collections stay dirty
                log.warning("retrieve: the snapshot writer ran %.0fs; killing it", SNAPSHOT_WRITER_MAX_S)
                try:
                    os.kill(pending.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            await asyncio.sleep(0.05)
        if self.core.snapshot_finish(pending):
            log.info("retrieve: snapshot of %d collections in %.2fs (searches paused %.1f ms for the fork)",
                     len(pending.plan.named), time.monotonic() - started, forked * 1e3)
        else:
            log.warning("retrieve: the snapshot writer failed (exit status above); the last whole snapshot stays")

    def _note(self) -> None:
        s = self.core.stats()
        self.rmetrics.set_state(s["collections"], s["documents"], s["memory_bytes"], self.lag)

    # -- searches ------------------------------------------------------------------------

    async def handle(self, records: list[ConsumerRecord]) -> None:
        if not self.ready.is_set():
            await self.ready.wait()  # the poll loop waits with it: nothing is searched on a partial index
        for r in records:
            await self._one(r)

    async def _one(self, r: ConsumerRecord) -> None:
        try:
            job = RetrieveJob.from_wire(unpack(r.value))
        except (DecodeError, ValueError, TypeError, RecursionError) as exc:
            self.metrics.to_dlq(STAGE)
            self.io.deliver([self.dlq(r, f"invalid_request: undecodable retrieve job: {exc}")], [r])
            return
        key = request_key(job.tenant, job.id)
        if self.answers.answered(key):
            self.io.finish([r])
            return
        started = now_ms()
        if job.deadline_at_ms <= started:
            self._fail(job, r, WireError(ErrorCode.DEADLINE_EXCEEDED, "the search reached the retrieve stage after "
                                         "its deadline"), started)
            return
        if job.query is not None and job.space is None and job.modality != "text":
            self._fail(job, r, WireError(ErrorCode.OVERLOADED, "the query's encoder did not say which model made it "
                                         "(a replica older than this retrieve stage, during a rollout)",
                                         "params.collection", REEMBED_RETRY_MS), started)
            return
        try:
            query = await self._query(job)
            async with self.lock:
                t0 = time.perf_counter()
                answer = self.core.search(job.tenant, job.collection, query, job.k, job.where,
                                          space=job.space if job.query is not None else None)
                self.rmetrics.observe_search(time.perf_counter() - t0, answer.reused)
        except UnknownCollection:
            what = "images" if job.modality == "image" and job.query is not None else "documents"
            self._fail(job, r, WireError(ErrorCode.INVALID_REQUEST, f"collection {job.collection!r} has no {what} "
                                         "(put some with `mmstream collection put`)", "params.collection"), started)
            return
        except NotReady:
            self._fail(job, r, WireError(ErrorCode.OVERLOADED, f"collection {job.collection!r} is being embedded again "
                                         "for the model that encoded this query (a model change); its previous "
                                         "index answers queries of the previous model", "params.collection",
                                         REEMBED_RETRY_MS), started)
            return
        except (ValueError, TypeError) as exc:
            self._fail(job, r, WireError(ErrorCode.INVALID_REQUEST, f"the query cannot search this collection: "
                                         f"{str(exc)[:200]}"), started)
            return
        if job.generate is not None:
            self._forward(job, r, answer, started)
        else:
            self._answer(job, r, answer, started)

    async def _query(self, job: RetrieveJob) -> np.ndarray:
        if job.query is not None:
            return np.asarray(from_wire(job.query), dtype=np.float32).reshape(-1)
        if job.query_text is None or self.embedder is None:
            raise ValueError("the job carries no query")
        got = (await asyncio.get_running_loop().run_in_executor(
            self.executor, self.embedder.embed, [job.query_text], job.tenant))[0]
        if isinstance(got, Exception):
            raise ValueError(f"the question could not be embedded: {type(got).__name__}")
        return got

    def _answer(self, job: RetrieveJob, r: ConsumerRecord, a: Answer, started: float) -> None:
        now = now_ms()
        hits = [{"id": h.doc_id, "score": round(float(h.score), 6), "text": t, "meta": h.meta}
                for h, t in zip(a.hits, a.texts)]
        ev = Event(job.id, EventKind.RESULT, TERMINAL_SEQ, now, timings=stage_timings(job, STAGE, started, now), payload={
            "task": "retrieve", "collection": job.collection, "hits": hits, "parts": job.parts,
            "index": {"documents": a.documents, "version": a.epoch, "reused": a.reused, "model": a.space}})
        self._terminal(job, r, [out_map(job.reply_to, job.id, ev.to_wire())])
        self.metrics.request_done(STAGE, "ok")
        self.metrics.observe_e2e("retrieve", job.lane, now - job.client_sent_at_ms)

    def _forward(self, job: RetrieveJob, r: ConsumerRecord, a: Answer, started: float) -> None:
        """RAG: the generate job with its passages, in id order (the same passages make the
        same prompt prefix, whatever their scores)."""
        cut = self.r.passage_chars
        passages = sorted(({"id": h.doc_id, "score": round(float(h.score), 6), "text": _cut(t, cut)}
                           for h, t in zip(a.hits, a.texts)), key=lambda p: p["id"])
        g = GenerateJob.from_wire(job.generate)
        now = now_ms()
        trace = [*g.trace, {"stage": STAGE, "queued_ms": round(max(0.0, started - job.sent_at_ms), 3),
                            "service_ms": round(now - started, 3)}]
        fwd = GenerateJob(**{**{f: getattr(g, f) for f in g.__dataclass_fields__}, "sent_at_ms": now,
                             "trace": trace, "passages": passages})
        self._terminal(job, r, [out_map(self.names.generate(fwd.lane), request_key(fwd.tenant, fwd.id), fwd.to_wire())])
        self.metrics.request_done(STAGE, "ok")

    def _fail(self, job: RetrieveJob, r: ConsumerRecord, err: WireError, started: float) -> None:
        now = now_ms()
        ev = Event(job.id, EventKind.ERROR, TERMINAL_SEQ, now, error=err.to_wire(),
                   timings=stage_timings(job, STAGE, started, now))
        self._terminal(job, r, [out_map(job.reply_to, job.id, ev.to_wire())])
        self.metrics.request_done(STAGE, "error", str(err.code))

    def _terminal(self, job: RetrieveJob, r: ConsumerRecord, outs: list[Out]) -> None:
        key = request_key(job.tenant, job.id)
        self.io.deliver(self.answers.finish(key, job.reply_to, outs, TERMINAL_SEQ, now_ms()), [r])

    # -- ownership -----------------------------------------------------------------------

    async def on_assigned(self, tps: set[TopicPartition]) -> None:
        assert self.io.consumer is not None
        k = self.settings.kafka
        try:
            found = await recover(self.io.consumer, k.bootstrap, self.io.settings.client_kwargs, k.max_message_bytes,
                                  self.names.retrieve_done, tps, _opens, now_ms(), self.answers.retention_ms)
        except Exception:
            log.exception("retrieve: recovery of %s failed; a replayed search may be answered again", tps)
            return
        self.answers.take_over(found)

    async def idle(self) -> None:
        self.answers.prune(now_ms())


async def _caught_up(consumer: AIOKafkaConsumer, tps: list[TopicPartition], target: dict[TopicPartition, int]) -> bool:
    for tp in tps:
        if await consumer.position(tp) < target[tp]:
            return False
    return True


def _opens(rec: ConsumerRecord) -> tuple[str, str, str] | None:
    job = RetrieveJob.from_wire(unpack(rec.value))
    return request_key(job.tenant, job.id), job.reply_to, job.id


def _decoded(value: bytes | None) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        m = unpack(value)
    except (DecodeError, ValueError):
        return {}  # the core counts it as malformed
    return m if isinstance(m, dict) else {}


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = text[:limit]
    return (head.rsplit(" ", 1)[0] if " " in head else head) + " ..."


def install_retrieve(app: faust.App, settings: Settings, metrics: Metrics, embedder: Embedder | None) -> None:
    core = RetrievalCore(embedder.identity if embedder is not None else "", core_limits(settings))
    RetrieveStage(app, settings, metrics, core, embedder).install()
