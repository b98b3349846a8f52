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
from streams.metrics import Metrics
from streams.metrics_retrieval import RetrievalMetrics
from streams.produce import Out
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
        outs: list[Out] = []
        todo: list[tuple[ConsumerRecord, str, str, str, Any]] = []
        for r in records:
            where = self.names.parse_docs(r.topic)
            if where is None:
                self._dead(r, "invalid_request: not a collection topic name")
                continue
            tenant, collection = where
            try:
                doc_id = doc_id_of(r.key)
                if r.value is None:
                    outs.append(Out(self.names.vectors, vector_key(tenant, collection, self.embedder.identity, doc_id),
                                    None))  # type: ignore[arg-type]  # a tombstone
                    self.rmetrics.indexed("delete")
                    continue
                doc = decode_document(r.value, self.r.max_doc_chars, self.r.max_meta_keys)
            except WireError as exc:
                self._dead(r, f"{exc.code}: {exc.message}")
                continue
            todo.append((r, tenant, collection, doc_id, doc))
        waiting = {id(t[0]) for t in todo}
        done = [r for r in records if id(r) not in waiting and (r.topic, r.partition, r.offset) not in self.io.handed]
        for batch in _batches(todo, self.r.index_batch):
            vectors = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.embedder.embed, [t[4].text for t in batch], batch[0][1])
            for (r, tenant, collection, doc_id, doc), v in zip(batch, vectors):
                if isinstance(v, Exception):
                    self._dead(r, f"{getattr(v, 'code', 'internal')}: the document could not be embedded: "
                                  f"{type(v).__name__}")
                    continue
                rec = VectorRecord(tenant=tenant, collection=collection, doc=doc_id, model=self.embedder.identity,
                                   vector=to_wire(v, "float16"), text=doc.text, meta=doc.meta,
                                   source=[r.partition, r.offset])
                outs.append(Out(self.names.vectors, vector_key(tenant, collection, self.embedder.identity, doc_id),
                                pack(rec.to_wire())))
                self.rmetrics.indexed("upsert")
            done.extend(r for r, *_ in batch)
        if outs:
            self.io.deliver(outs, done)
        elif done:
            self.io.finish(done)

    def _dead(self, r: ConsumerRecord, reason: str) -> None:
        self.metrics.to_dlq(STAGE)
        self.io.deliver([self.dlq(r, reason)], [r])


def _batches(todo: list[Any], size: int) -> list[list[Any]]:
    """``todo`` cut into engine calls of at most ``size`` documents, each of one tenant (the
    reuse cache keys on the tenant), in their order within each tenant."""
    by_tenant: dict[str, list[Any]] = {}
    for t in todo:
        by_tenant.setdefault(t[1], []).append(t)
    return [items[i:i + size] for items in by_tenant.values() for i in range(0, len(items), size)]


def install_indexer(app: faust.App, settings: Settings, metrics: Metrics, embedder: TextEmbedder) -> IndexerStage:
    return IndexerStage(app, settings, metrics, embedder).install()
