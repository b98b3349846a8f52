"""The indexing stage: every tenant's collection topics in, document embeddings out.

It subscribes by pattern to ``<p>.docs.<tenant>.<collection>`` (topics created while it runs
are found at the next metadata refresh), takes the tenant and the collection from the topic
name (the broker's ACLs let only that tenant write there), embeds each document with the
encoder the pipeline serves for its modality (``workers.retrieval.embed``: same model,
version and reuse cache as ``encode.text`` for a passage, ``encode.image`` for an image) and
writes a ``schemas.documents.VectorRecord`` to the compacted ``<p>.vectors`` topic; a
tombstone becomes a tombstone there (in every space it serves: a document's modality may
have changed). Its input is committed only after the vectors are with the broker, so a crash
repeats documents (an upsert of the same vector: harmless) and never loses one.

Each partition of a collection it has caught up with (after a batch, or when a poll finds
nothing new) for the first time in this process gets a ready marker per space
(``schemas.documents.ready_key``): what tells the retrieve stage that a space holds the whole
collection.

A document it cannot index (a bad key, undecodable, over ``retrieval.max_doc_chars``) is
dead-lettered alone with its stable code: a collection has no reply topic to answer on.

Its consumer group is named after the encoders' identities: a new model version starts a new
group, which reads every collection from the beginning and writes vectors in the new space
beside the old ones (keys carry the model), while the old ones still answer (documents of
the unchanged modality are re-read too: their embeddings are reuse-cache hits and their
vectors the same keys).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import faust
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from schemas.codec import pack
from schemas.documents import Document, VectorRecord, decode_document, doc_id_of, ready_key, vector_key
from schemas.errors import WireError
from schemas.settings import Settings
from schemas.tensor import to_wire
from streams.app import topic_names
from streams.observe.metrics import Metrics
from streams.observe.metrics_retrieval import RetrievalMetrics
from streams.runtime.produce import Out
from streams.runtime.stage import RecordStage
from workers.retrieval.embed import Embedder

log = logging.getLogger(__name__)
STAGE = "index"
RETRY_S = 30.0
"""How long a document refused for a retriable reason is tried again before it is dead-lettered."""


def indexer_group(prefix: str, identities: list[str]) -> str:
    """The indexing stage's consumer group for the encoder identities it embeds with."""
    digest = hashlib.sha256("|".join(sorted(identities)).encode()).hexdigest()[:12]
    return f"{prefix}-index-{digest}"


class IndexerStage(RecordStage):
    stage = STAGE

    def __init__(self, app: faust.App, settings: Settings, metrics: Metrics, embedders: dict[str, Embedder]) -> None:
        names = topic_names(settings)
        super().__init__(app, settings, [], [], pattern=names.docs_pattern(),
                         group_id=indexer_group(settings.kafka.topic_prefix, [e.identity for e in embedders.values()]))
        self.metrics = metrics
        self.rmetrics = RetrievalMetrics(metrics)
        self.embedders = embedders
        """Modality -> its encoder's embedder (text always; image where the deployment serves it)."""
        self.r = settings.retrieval
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine-index")
        self.marked: set[tuple[str, int]] = set()
        """(docs topic, partition) whose ready markers this process wrote."""
        self.deliveries: set[asyncio.Task] = set()
        """Vectors in flight to the broker: a ready marker waits for them."""

    def lane_of_topic(self, topic: str) -> str:
        return "bulk"  # indexing is background work: no rt records to put first

    async def handle(self, records: list[ConsumerRecord]) -> None:
        """Outputs in the order of their inputs (a document put and deleted in one poll ends
        deleted); a document superseded by a later record of its id in the same poll is not
        embedded at all (only the last record per id counts on a compacted topic)."""
        last: dict[tuple[str, bytes | None], int] = {}
        for i, r in enumerate(records):
            last[(r.topic, r.key)] = i
        plan: list[tuple[ConsumerRecord, str | None, Any]] = []  # (record, model, (tenant, collection, id, None | Document))
        for i, r in enumerate(records):
            where = self.names.parse_docs(r.topic)
            if where is None:
                self._dead(r, "invalid_request: not a collection topic name")
                continue
            tenant, collection = where
            try:
                doc_id = doc_id_of(r.key)
                if last[(r.topic, r.key)] != i:
                    continue  # superseded: finished with the batch, never embedded
                doc = None if r.value is None else decode_document(r.value, self.r.max_doc_chars,
                                                                    self.r.max_meta_keys, self.r.max_doc_image_bytes)
            except WireError as exc:
                self._dead(r, f"{exc.code}: {exc.message}")
                continue
            embedder = None if doc is None else self.embedders.get(doc.modality)
            if doc is not None and embedder is None:
                self._dead(r, f"unsupported_media: this deployment does not serve {doc.modality} documents")
                continue
            plan.append((r, None if embedder is None else embedder.identity, (tenant, collection, doc_id, doc)))
        vectors = await self._embed([p for p in plan if p[2][3] is not None])
        outs: list[Out] = []
        for r, model, (tenant, collection, doc_id, doc) in plan:
            if doc is None:  # a tombstone in every space: the document may have changed modality
                outs.extend(Out(self.names.vectors, vector_key(tenant, collection, e.identity, doc_id), None)  # type: ignore[arg-type]
                            for e in self.embedders.values())
                self.rmetrics.indexed("delete")
                continue
            assert model is not None  # a document has its modality's embedder (checked above)
            stale = [e.identity for e in self.embedders.values() if e.identity != model]
            outs.extend(Out(self.names.vectors, vector_key(tenant, collection, m, doc_id), None)  # type: ignore[arg-type]
                        for m in stale)  # an id that was a passage and is now an image leaves the text space
            v = vectors[id(r)]
            if isinstance(v, Exception):
                self._dead(r, f"{getattr(v, 'code', 'internal')}: the document could not be embedded: "
                              f"{type(v).__name__}")
                continue
            rec = VectorRecord(tenant=tenant, collection=collection, doc=doc_id, model=model,
                               vector=to_wire(v, "float16"), text=doc.text, meta=doc.meta,
                               source=[r.partition, r.offset])
            outs.append(Out(self.names.vectors, vector_key(tenant, collection, model, doc_id), pack(rec.to_wire())))
            self.rmetrics.indexed("upsert")
        done = [r for r in records if (r.topic, r.partition, r.offset) not in self.io.handed]
        if outs:
            task = self.io.deliver(outs, done)
            self.deliveries.add(task)
            task.add_done_callback(self.deliveries.discard)
        elif done:
            self.io.finish(done)
        if self.io.consumer is not None:  # every partition: a quiet collection beside a busy one too
            await self._mark(self.io.consumer.assignment())

    async def _embed(self, todo: list[tuple[ConsumerRecord, str | None, Any]]) -> dict[int, Any]:
        """id(record) -> its document's unit vector or the exception that refused it. A
        retriable refusal (Redis away while a ref is read) is tried again, for up to
        ``RETRY_S``, before it counts: a document is not dead-lettered for an outage."""
        out: dict[int, Any] = {}
        for batch in _batches(todo, {"text": self.r.index_batch, "image": self.r.index_image_batch}):
            doc: Document = batch[0][2][3]
            embed = self.embedders[doc.modality].embed
            waited, pause = 0.0, 0.5
            while batch:
                got = await asyncio.get_running_loop().run_in_executor(
                    self.executor, embed, [p[2][3] for p in batch], batch[0][2][0])
                out.update((id(p[0]), v) for p, v in zip(batch, got))
                batch = [p for p, v in zip(batch, got) if getattr(v, "retriable", False)]
                if batch and waited < RETRY_S and not self.should_stop:
                    await asyncio.sleep(pause)
                    waited, pause = waited + pause, min(pause * 2, 8.0)
                else:
                    break
        return out

    async def idle(self) -> None:
        """Nothing new in this poll: every assigned partition may be caught up with."""
        if self.io.consumer is not None:
            await self._mark(self.io.consumer.assignment())

    async def _mark(self, tps: Any) -> None:
        """A ready marker, per space, for each of ``tps`` caught up with (its position at the
        last fetch's high watermark) for the first time in this process, sent once every
        vector handed to the producer before it is with the broker (none if a revoke dropped
        some: the partition's next owner marks it)."""
        consumer = self.io.consumer
        if consumer is None:
            return
        caught: list[tuple[TopicPartition, tuple[str, str], int]] = []
        for tp in tps:
            if (tp.topic, tp.partition) in self.marked:
                continue
            where = self.names.parse_docs(tp.topic)
            try:
                high = consumer.highwater(tp)
                if where is None or high is None or await consumer.position(tp) < high:
                    continue
            except Exception:  # noqa: BLE001 - revoked meanwhile: its next owner marks it
                continue
            partitions = len(consumer.partitions_for_topic(tp.topic) or ())
            if partitions:
                caught.append((tp, where, partitions))
        if not caught:
            return
        landed = await asyncio.gather(*list(self.deliveries), return_exceptions=True)
        if not all(x is True for x in landed):
            return
        outs: list[Out] = []
        for tp, where, partitions in caught:
            self.marked.add((tp.topic, tp.partition))
            value = pack({"ready": [tp.partition, partitions]})
            outs.extend(Out(self.names.vectors, ready_key(*where, e.identity, tp.partition), value)
                        for e in self.embedders.values())
        self.io.deliver(outs)

    async def on_revoked(self, tps: set[TopicPartition]) -> None:
        await super().on_revoked(tps)
        self.marked -= {(tp.topic, tp.partition) for tp in tps}

    def _dead(self, r: ConsumerRecord, reason: str) -> None:
        self.metrics.to_dlq(STAGE)
        self.io.deliver([self.dlq(r, reason)], [r])


def _batches(todo: list[Any], sizes: dict[str, int]) -> list[list[Any]]:
    """``todo`` (``(record, model, (tenant, ..., document))``) cut into engine calls of at most
    ``sizes[modality]`` documents, each of one tenant (the reuse cache keys on the tenant) and
    modality: an image batch holds at most that many images' bytes."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for t in todo:
        groups.setdefault((t[2][0], t[2][3].modality), []).append(t)
    out = []
    for (_, modality), items in groups.items():
        size = sizes.get(modality, 1)
        out += [items[i:i + size] for i in range(0, len(items), size)]
    return out


def install_indexer(app: faust.App, settings: Settings, metrics: Metrics,
                    embedders: dict[str, Embedder]) -> IndexerStage:
    return IndexerStage(app, settings, metrics, embedders).install()
