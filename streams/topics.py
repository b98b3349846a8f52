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
own ingress and reply topics (``streams.tenancy``), created by `mmstream tenant add`.

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

import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from schemas.request import Lane
from schemas.settings import DlqSettings, KafkaSettings
from schemas.request import COLLECTION_RE
from schemas.request import TENANT_RE as REQUEST_TENANT_RE
from streams.tenancy import TENANT_RE, tenant_docs, tenant_ingress, tenant_results
from workers import modalities

log = logging.getLogger(__name__)

LANES = (Lane.RT, Lane.BULK)
ANY = "any"
"""The shared encode topic of the no-routing baseline (one generic pool for every modality)."""


DONE_RETENTION_MS = 3_600_000
"""How long the done markers stay: past the longest deadline a request can be replayed for."""


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str
    partitions: int
    purpose: str
    config: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TopicNames:
    prefix: str

    def ingress(self, lane: Lane | str) -> str:
        return f"{self.prefix}.ingress.{lane}"

    def encode(self, modality: str, lane: Lane | str) -> str:
        return f"{self.prefix}.encode.{modality}.{lane}"

    def encoded(self, lane: Lane | str) -> str:
        return f"{self.prefix}.encoded.{lane}"

    def generate(self, lane: Lane | str) -> str:
        return f"{self.prefix}.generate.{lane}"

    def retrieve(self, lane: Lane | str) -> str:
        return f"{self.prefix}.retrieve.{lane}"

    @property
    def vectors(self) -> str:
        return f"{self.prefix}.vectors"

    def docs(self, tenant: str, collection: str) -> str:
        return tenant_docs(self.prefix, tenant, collection)

    def docs_pattern(self) -> str:
        """A regular expression matching every tenant's collection topics."""
        return rf"^{re.escape(self.prefix)}\.docs\..+$"

    def parse_docs(self, topic: str) -> tuple[str, str] | None:
        """(tenant, collection) of a collection topic, None for any other topic or a name
        whose tenant or collection is not a valid one."""
        head = f"{self.prefix}.docs."
        if not topic.startswith(head):
            return None
        tenant, dot, collection = topic[len(head):].rpartition(".")
        if not dot or not REQUEST_TENANT_RE.fullmatch(tenant) or not COLLECTION_RE.fullmatch(collection):
            return None
        return tenant, collection

    @property
    def results(self) -> str:
        return f"{self.prefix}.results"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}.dlq"

    def tenant_ingress(self, lane: Lane | str, tenant: str) -> str:
        return tenant_ingress(self.prefix, str(lane), tenant)

    def tenant_results(self, tenant: str) -> str:
        return tenant_results(self.prefix, tenant)

    def ingress_pattern(self) -> str:
        """A regular expression matching the shared ingress topics and every tenant's."""
        return _ingress_pattern(self.prefix)

    def parse_ingress(self, topic: str) -> tuple[str, str | None] | None:
        """(lane, tenant) of an ingress topic (tenant None for a shared one); None for any
        other topic. Called per record and per assigned partition: the pattern is compiled once."""
        m = _ingress_re(self.prefix).fullmatch(topic)
        if m is None:
            return None
        return m.group(1), (m.group(2)[1:] if m.group(2) else None)

    def in_reply_namespace(self, topic: str, tenant: str) -> bool:
        """Whether ``topic`` is ``<p>.results.<tenant>`` or under ``<p>.results.<tenant>.``."""
        own = self.tenant_results(tenant)
        return topic == own or topic.startswith(own + ".")

    def is_internal(self, topic: str) -> bool:
        """A topic no client may have answers written to: every ``<p>.*`` topic but the reply
        topics (``<p>.results`` and ``<p>.results.*``), Faust's ``<p>-*`` topics, changelogs,
        and Kafka's own ``__*`` topics."""
        if topic.startswith("__") or topic.endswith("-changelog") or topic.startswith(f"{self.prefix}-"):
            return True
        if topic.startswith(f"{self.prefix}."):
            return not (topic == self.results or topic.startswith(self.results + "."))
        return False

    @property
    def assembler_done(self) -> str:
        """Requests the assembler answered (compacted; partitioned like the encoded topics)."""
        return f"{self.prefix}.assembler.done"

    @property
    def retrieve_done(self) -> str:
        """Searches the retrieve stage answered or forwarded (compacted; partitioned like its input)."""
        return f"{self.prefix}.retrieve.done"

    @property
    def generator_done(self) -> str:
        """Generations the generator finished (compacted; partitioned like the generate topics)."""
        return f"{self.prefix}.generator.done"


def _ingress_pattern(prefix: str) -> str:
    lanes = "|".join(str(lane) for lane in LANES)
    return rf"^{re.escape(prefix)}\.ingress\.({lanes})(\.{TENANT_RE})?$"


@functools.lru_cache(maxsize=16)
def _ingress_re(prefix: str) -> re.Pattern[str]:
    return re.compile(_ingress_pattern(prefix))


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
    the admin client's security options (``streams.security.client_kwargs``).

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
