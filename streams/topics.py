"""The one table of topics: names, partition counts and configs, created at start-up.

Names follow DESIGN.md with a configurable prefix (``mm`` by default; tests use a unique
one per run so they never see each other's records):

    <p>.ingress.<lane>            client requests
    <p>.encode.<modality>.<lane>  one part of one request, for that modality's pool (one per
                                  registered modality, workers/modalities, plus ``any``)
    <p>.encoded.<lane>            manifests, encoded parts and deadline ticks, keyed by id
    <p>.generate.<lane>           assembled generate jobs
    <p>.retrieve.<lane>           searches of a collection (retrieve, and RAG generate)
    <p>.docs.<tenant>.<collection>  a collection's documents (compacted; `mmstream collection add`)
    <p>.vectors                   every collection's document embeddings (compacted, internal)
    <p>.results                   default reply topic
    <p>.dlq                       undecodable input, with its original headers

With an authenticating broker (``KafkaSettings.authenticated``) each tenant also has its
own ingress and reply topics (named in ``schemas.topics``, the one source of topic
names), created by `mmstream tenant add`.

Every other ``<p>.*`` topic is internal: written by the pipeline's service principal only,
never a valid ``reply_to`` (``is_internal``).

Every topic is stored uncompressed (``compression.type=uncompressed``): the broker then
unpacks a compressed batch before storing it and refuses it when the result is over
``max.message.bytes``, so no consumer of ours ever decompresses more than that (a few KB
of gzip can unpack to gigabytes). No producer of the pipeline compresses. The DLQ keeps
``dlq.retention_ms`` and at most ``dlq.retention_bytes`` per partition. These configs are
set when a topic is created; an existing one keeps its own (``kafka-configs --alter``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from schemas.settings import DlqSettings, KafkaSettings
from schemas.topics import ANY, LANES, TopicNames, tenant_docs
from workers import modalities

log = logging.getLogger(__name__)

DONE_RETENTION_MS = 3_600_000
"""How long the done markers stay: past the longest deadline a request can be replayed for."""


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int
    purpose: str
    config: dict[str, str] = field(default_factory=dict)


def _big(kafka: KafkaSettings) -> dict[str, str]:
    """The configs of a topic that carries requests, jobs or answers: records up to the
    settings' size, stored uncompressed (no decompression bomb reaches a consumer)."""
    return {"max.message.bytes": str(kafka.max_message_bytes), "compression.type": "uncompressed"}


def topic_specs(kafka: KafkaSettings, dlq: DlqSettings | None = None) -> list[TopicSpec]:
    """Every topic the pipeline uses (encode topics for the modalities registered now). All
    stage topics share one partition count so the assembler's table (partitioned like its
    input) stays co-partitioned. ``dlq``: the DLQ's retention (default: the settings' defaults)."""
    names = TopicNames(kafka.topic_prefix)
    n = kafka.partitions
    dlq = dlq or DlqSettings()
    big = _big(kafka)
    specs: list[TopicSpec] = []
    for lane in LANES:
        specs.append(TopicSpec(names.ingress(lane), n, f"client requests, {lane} lane", big))
        for modality in (*modalities.names(), ANY):
            specs.append(TopicSpec(names.encode(modality, lane), n, f"{modality} encode jobs, {lane} lane", big))
        specs.append(TopicSpec(names.encoded(lane), n, f"fan-in to the assembler, {lane} lane", big))
        specs.append(TopicSpec(names.generate(lane), n, f"generate jobs, {lane} lane", big))
        specs.append(TopicSpec(names.retrieve(lane), n, f"collection searches, {lane} lane", big))
    # Which requests were answered: read back by a replica that takes over a partition, so a
    # replayed request is not answered twice. Compacted (one record per request), and
    # deleted after a while: only requests whose records can still be replayed matter.
    done = {"cleanup.policy": "compact,delete", "retention.ms": str(DONE_RETENTION_MS),
            "segment.ms": str(DONE_RETENTION_MS // 4), "compression.type": "uncompressed"}
    specs.append(TopicSpec(names.assembler_done, n, "requests the assembler answered", done))
    specs.append(TopicSpec(names.generator_done, n, "generations the generator finished", done))
    specs.append(TopicSpec(names.router_done, n, "requests the router answered itself", done))
    specs.append(TopicSpec(names.retrieve_done, n, "searches the retrieve stage answered", done))
    specs.append(TopicSpec(names.results, n, "default reply topic", big))
    specs.append(TopicSpec(names.vectors, n, "document embeddings of every collection (the indexes' source)",
                           {**big, "cleanup.policy": "compact"}))
    # Segments roll at least hourly (and well under the byte cap), so retention can act.
    kept = {**big, "retention.ms": str(dlq.retention_ms), "retention.bytes": str(dlq.retention_bytes),
            "segment.ms": str(min(dlq.retention_ms, 3_600_000)),
            "segment.bytes": str(max(1024 * 1024, min(dlq.retention_bytes // 4, 1024 ** 3)))}
    specs.append(TopicSpec(names.dlq, 1, "undecodable input with original headers", kept))
    return specs


def tenant_topic_specs(kafka: KafkaSettings, tenant: str, lanes: tuple[str, ...] = tuple(LANES)) -> list[TopicSpec]:
    """A tenant's own topics: its ingress on each of ``lanes`` and its reply topic."""
    names = TopicNames(kafka.topic_prefix)
    n = kafka.partitions
    big = _big(kafka)
    specs = [TopicSpec(names.tenant_ingress(lane, tenant), n, f"requests of tenant {tenant}, {lane} lane", big)
             for lane in lanes]
    specs.append(TopicSpec(names.tenant_results(tenant), n, f"reply topic of tenant {tenant}", big))
    return specs


def collection_spec(kafka: KafkaSettings, tenant: str, collection: str, partitions: int | None = None) -> TopicSpec:
    """A collection's documents topic: compacted (the last record per document id is the
    collection), records up to the settings' size."""
    return TopicSpec(tenant_docs(kafka.topic_prefix, tenant, collection), partitions or kafka.partitions,
                     f"documents of collection {collection} of tenant {tenant}",
                     {**_big(kafka), "cleanup.policy": "compact"})


async def ensure_topics(bootstrap: str, specs: list[TopicSpec], replication_factor: int = 1,
                        client_kwargs: dict[str, Any] | None = None) -> list[str]:
    """Create the topics that do not exist yet; return the names created. ``client_kwargs``:
    the admin client's security options (``streams.connection.client_kwargs``).

    Existing topics are left alone; one with a different partition count is logged, since
    changing it would move keys between partitions.
    """
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **(client_kwargs or {}))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [s for s in specs if s.name not in existing]
        if missing:
            try:
                await admin.create_topics(
                    [NewTopic(s.name, s.partitions, replication_factor, topic_configs=s.config) for s in missing]
                )
            except TopicAlreadyExistsError:
                pass  # another process created them first
        present = [s for s in specs if s.name in existing]
        if present:
            described = await admin.describe_topics([s.name for s in present])
            counts = {d["topic"]: len(d["partitions"]) for d in described}
            for s in present:
                if counts.get(s.name, s.partitions) != s.partitions:
                    log.warning("topic %s has %s partitions, settings ask for %s; leaving it",
                                s.name, counts[s.name], s.partitions)
        return [s.name for s in missing]
    finally:
        await admin.close()
