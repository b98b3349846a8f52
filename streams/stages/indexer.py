"""The indexing stage: every tenant's collection topics in, document embeddings out.

It subscribes by pattern to ``<p>.docs.<tenant>.<collection>`` (topics created while it runs
are found at the next metadata refresh), takes the tenant and the collection from the topic
name (the broker's ACLs let only that tenant write there), embeds each document with the
text encoder the pipeline serves (``workers.retrieval.embed``: same model, version and reuse
cache as ``encode.text``) and writes a ``schemas.documents.VectorRecord`` to the compacted
``<p>.vectors`` topic; a tombstone becomes a tombstone there. Its input is committed only
after the vectors are with the broker, so a crash repeats documents (an upsert of the same
vector: harmless) and never loses one.

A document it cannot index (a bad key, undecodable, over ``retrieval.max_doc_chars``) is
dead-lettered alone with its stable code: a collection has no reply topic to answer on.

Its consumer group is named after the encoder's identity: a new model version starts a new
group, which reads every collection from the beginning and writes vectors in the new space
beside the old ones (keys carry the model), while the old ones still answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import faust
from aiokafka.structs import ConsumerRecord

from schemas.codec import pack
from schemas.documents import VectorRecord, decode_document, doc_id_of, vector_key
from schemas.errors import WireError
from schemas.settings import Settings
from schemas.tensor import to_wire
from streams.app import topic_names
from streams.observe.metrics import Metrics
from streams.observe.metrics_retrieval import RetrievalMetrics
from streams.runtime.produce import Out
from streams.runtime.stage import RecordStage
from workers.retrieval.embed import TextEmbedder

log = logging.getLogger(__name__)
STAGE = "index"


def indexer_group(prefix: str, identity: str) -> str:
    """The indexing stage's consumer group for one encoder identity."""
    digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    return f"{prefix}-index-{digest}"


class IndexerStage(RecordStage):
    stage = STAGE

    def __init__(self, app: faust.App, settings: Settings, metrics: Metrics, embedder: TextEmbedder) -> None:
        names = topic_names(settings)
        super().__init__(app, settings, [], [], pattern=names.docs_pattern(),
                         group_id=indexer_group(settings.kafka.topic_prefix, embedder.identity))
        self.metrics = metrics
        self.rmetrics = RetrievalMetrics(metrics)
        self.embedder = embedder
        self.r = settings.retrieval
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine-index")

    def lane_of_topic(self, topic: str) -> str:
        return "bulk"  # indexing is background work: no rt records to put first

    async def handle(self, records: list[ConsumerRecord]) -> None:
        """Outputs in the order of their inputs (a document put and deleted in one poll ends
        deleted); a document superseded by a later record of its id in the same poll is not
        embedded at all (only the last record per id counts on a compacted topic)."""
        last: dict[tuple[str, bytes | None], int] = {}
        for i, r in enumerate(records):
            last[(r.topic, r.key)] = i
        plan: list[tuple[ConsumerRecord, bytes, Any]] = []  # (record, vector key, None | Document)
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
                                                                    self.r.max_meta_keys)
            except WireError as exc:
                self._dead(r, f"{exc.code}: {exc.message}")
                continue
            plan.append((r, vector_key(tenant, collection, self.embedder.identity, doc_id), (tenant, collection,
                                                                                              doc_id, doc)))
        vectors = await self._embed([p for p in plan if p[2][3] is not None])
        outs: list[Out] = []
        for r, key, (tenant, collection, doc_id, doc) in plan:
            if doc is None:
                outs.append(Out(self.names.vectors, key, None))  # type: ignore[arg-type]  # a tombstone
                self.rmetrics.indexed("delete")
                continue
            v = vectors[id(r)]
            if isinstance(v, Exception):
                self._dead(r, f"{getattr(v, 'code', 'internal')}: the document could not be embedded: "
                              f"{type(v).__name__}")
                continue
            rec = VectorRecord(tenant=tenant, collection=collection, doc=doc_id, model=self.embedder.identity,
                               vector=to_wire(v, "float16"), text=doc.text, meta=doc.meta,
                               source=[r.partition, r.offset])
            outs.append(Out(self.names.vectors, key, pack(rec.to_wire())))
            self.rmetrics.indexed("upsert")
        done = [r for r in records if (r.topic, r.partition, r.offset) not in self.io.handed]
        if outs:
            self.io.deliver(outs, done)
        elif done:
            self.io.finish(done)

    async def _embed(self, todo: list[tuple[ConsumerRecord, bytes, Any]]) -> dict[int, Any]:
        """id(record) -> its document's unit vector or the exception that refused it."""
        out: dict[int, Any] = {}
        for batch in _batches(todo, self.r.index_batch):
            got = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.embedder.embed, [p[2][3].text for p in batch], batch[0][2][0])
            out.update((id(p[0]), v) for p, v in zip(batch, got))
        return out

    def _dead(self, r: ConsumerRecord, reason: str) -> None:
        self.metrics.to_dlq(STAGE)
        self.io.deliver([self.dlq(r, reason)], [r])


def _batches(todo: list[Any], size: int) -> list[list[Any]]:
    """``todo`` (``(record, key, (tenant, ...))``) cut into engine calls of at most ``size``
    documents, each of one tenant (the reuse cache keys on the tenant)."""
    by_tenant: dict[str, list[Any]] = {}
    for t in todo:
        by_tenant.setdefault(t[2][0], []).append(t)
    return [items[i:i + size] for items in by_tenant.values() for i in range(0, len(items), size)]


def install_indexer(app: faust.App, settings: Settings, metrics: Metrics, embedder: TextEmbedder) -> IndexerStage:
    return IndexerStage(app, settings, metrics, embedder).install()
