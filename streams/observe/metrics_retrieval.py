"""The retrieval lever's metrics, on a stage's ``streams.observe.metrics.Metrics`` registry: index
size, search time, reuse hit rate, how far an index is behind its topic, documents indexed."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from streams.observe.metrics import LATENCY_BUCKETS_S, Metrics


class RetrievalMetrics:
    def __init__(self, metrics: Metrics) -> None:
        make = metrics._make
        self.collections = make(Gauge, "mmstream_retrieval_collections", "Collections this replica holds an index of.", ())
        self.documents = make(Gauge, "mmstream_retrieval_documents", "Documents in this replica's indexes.", ())
        self.index_bytes = make(Gauge, "mmstream_retrieval_index_bytes",
                                "Bytes this replica's indexes hold (stored vectors and graphs).", ())
        self.staleness = make(Gauge, "mmstream_retrieval_vectors_lag",
                              "Records of the vectors topic this replica has not applied yet (index staleness).", ())
        self.search_seconds = make(Histogram, "mmstream_retrieval_search_seconds",
                                   "Time of one search of a collection, by how it was answered (search, reuse).",
                                   ("answer",), buckets=LATENCY_BUCKETS_S)
        self.indexed_total = make(Counter, "mmstream_retrieval_indexed",
                                  "Documents the indexing stage embedded (upsert) or deleted (delete).", ("op",))

    def set_state(self, collections: int, documents: int, index_bytes: int, lag: int) -> None:
        self.collections.set(collections)
        self.documents.set(documents)
        self.index_bytes.set(index_bytes)
        self.staleness.set(lag)

    def observe_search(self, seconds: float, reused: bool) -> None:
        self.search_seconds.labels("reuse" if reused else "search").observe(seconds)

    def indexed(self, op: str) -> None:
        self.indexed_total.labels(op).inc()
